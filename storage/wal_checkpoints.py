"""The write-ahead log's checkpoints (``storage.wal``): a flush of the whole file system
that moves the boot's checkpoint mark and removes the segments it covers (this process's
retired ones, and those of processes of the boot that have exited); refused for the rest
of the boot once a flush of it failed, in this process or another (``failed-<boot>``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable

from storage.wal_marks import (
    _folder_lock,
    _write_mark,
    failure_recorded,
    read_mark,
    record_failure,
    syncfs,
)
from storage.wal_records import _SUFFIX, _header, _Segment

log = logging.getLogger(__name__)

CHECKPOINT_AFTER_S = 30.0


class CheckpointRefused(OSError):
    """A checkpoint that wrote no mark and removed no log: a flush of the file system
    failed earlier in this boot (``reason`` says which, where this process saw it)."""

    def __init__(self, folder: str, reason: str) -> None:
        super().__init__(errno.EIO, reason, folder)
        self.reason = reason


class LogCheckpoints:
    """The checkpoints of a log (``WriteAheadLog``), and the looks for a failed one of
    another process; the state they share is ``LogSegments``'s."""

    folder: str
    boot: str
    not_checkpointing: str | None
    _lock: threading.Lock
    _told: threading.Lock
    _said: bool
    _watched: list[Callable[[], object]]
    _segment: _Segment | None
    _retired: list[_Segment]
    _checkpointing: bool

    # -- checkpoints -------------------------------------------------------------------

    def _checkpoint(self) -> None:
        while True:
            with self._lock:
                retired, self._retired = self._retired, []
                if not retired:
                    self._checkpointing = False
                    return
            try:
                self.checkpoint(retired)
            except Exception as exc:  # the segments stay: a replay will only do more work
                if self.not_checkpointing is None:
                    log.warning(
                        "write-ahead log checkpoint failed in %s", self.folder, exc_info=True
                    )
                else:  # the flush's own traceback, if it failed here
                    self._say_not_checkpointing(traceback=not isinstance(exc, CheckpointRefused))
            finally:
                for segment in retired:
                    with contextlib.suppress(OSError):
                        os.close(segment.fd)

    def _say_not_checkpointing(self, *, traceback: bool) -> None:
        """Log why the log no longer checkpoints, the first time only: every checkpoint of
        the boot fails from now on, for the same reason, and a line a checkpoint would
        say nothing new; the store's health says it while it lasts. ``traceback``: the
        exception being handled, to log with it."""
        with self._told:
            if self._said:
                return
            self._said = True
        log.warning(
            "write-ahead log in %s no longer checkpoints: %s; its logs are kept"
            " until a reboot replays them",
            self.folder,
            self.not_checkpointing,
            exc_info=traceback,
        )

    def watch(self, look: Callable[[], object]) -> None:
        """Have the ager call ``look`` at each of its looks (every ``AGE_POLL_S``), as it
        looks for ``failed-<boot>``: another marker of a failed flush (``record_failure``)
        that a process which does not write would otherwise never look for, and whose
        health would stay clean. ``look`` must not raise, nor block for long."""
        self._watched.append(look)

    def _look_for_failure(self) -> None:
        """The ager's look for a checkpoint of another process that failed its flush in
        this boot: a process that writes finds it at its next checkpoint, but one that
        has not written since runs none, and would report a clean health for as long as
        it stays quiet. The looks it was asked for too (``watch``)."""
        if self._learn_of_failure():
            self._say_not_checkpointing(traceback=False)
        for look in tuple(self._watched):
            look()

    def _learn_of_failure(self) -> bool:
        """Whether ``failed-<boot>`` is newly found beside the marks (a stat, until it is
        found): ``not_checkpointing`` then says so."""
        with self._told:
            # Under ``_told``: a checkpoint of this process whose flush failed sets its own
            # reason before it writes the file, so that one is never taken for another
            # process's.
            if self.not_checkpointing is not None:
                return False
            if not failure_recorded(self.folder, self.boot):
                return False
            self.not_checkpointing = "a flush of the file system failed in another process"
            return True

    def checkpoint(self, retired: list[_Segment]) -> None:
        """Flush the file system and remove ``retired`` and the segments of exited
        processes of this boot: everything they record is on disk once the flush is."""
        mine = {s.path for s in retired}
        current = self._segment  # once: the ager may switch it meanwhile
        if current is not None:
            mine.add(current.path)
        exited = [p for p in self._segments() if p not in mine and self._exited(p)]
        mark = time.monotonic_ns()  # after the segments were chosen: all they hold is older
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            syncfs(fd)
        except OSError as exc:
            # Linux reports a failed writeback once and then counts the pages clean, so
            # a later flush that succeeds proves nothing about the changes this one
            # covered: no checkpoint of this boot, in any process, may vouch for them
            # again (a mark past them, their segments removed). The logs stay, to be
            # replayed after a reboot.
            #
            # Nor would a flush of each kept segment file clear them: the segments were
            # flushed already (``_retire``), and what this flush failed to write is the
            # objects' files (or folders), which the mark vouches for and which Linux
            # now counts clean. Only each change made again in its object's file, that
            # file flushed, would; and made now, over a newer change another process
            # logged meanwhile, it would undo that one. The reboot's replay orders them.
            with self._told:
                self.not_checkpointing = f"a flush of the file system failed ({exc})"
            with _folder_lock(self.folder, ".marks.lock"):
                record_failure(self.folder, self.boot)
            raise
        finally:
            os.close(fd)
        with _folder_lock(self.folder, ".marks.lock"):
            self._learn_of_failure()  # said by ``_checkpoint``, not under the folder's lock
            if self.not_checkpointing is not None:
                raise CheckpointRefused(self.folder, self.not_checkpointing)
            if mark > read_mark(self.folder, self.boot):
                _write_mark(self.folder, self.boot, mark)
        for path in [s.path for s in retired] + exited:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _segments(self) -> list[str]:
        return sorted(
            f"{self.folder}/{name}" for name in os.listdir(self.folder) if name.endswith(_SUFFIX)
        )

    def _exited(self, path: str) -> bool:
        """Whether ``path`` is a segment of this boot whose process has exited."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its process holds it
            header = _header(fd)
            # Header-less: a process that died while it made the segment ready.
            return header == self.boot or (header is None and _age_s(path) > CHECKPOINT_AFTER_S)
        finally:
            os.close(fd)


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0
