"""The local folder store's write-ahead log: one flush for a group of changes' names.

Every durable write of the folder store used to flush its own file before linking it into
place, and the directory entry itself was never flushed. Now the store renames the
object's file into place (its bytes flushed first: ``local_folder._written`` says why),
and appends the change (key, whole content or removal, a timestamp) to a log of its
process's own; one ``fdatasync`` of that log, a preallocated file whose size does not
change, makes every record appended meanwhile durable (0.13 ms here, for all of them at
once). A write is acknowledged only after that flush. A flush that fails loses the
records it covered for good (``sync`` raises for them ever after): Linux reports a failed
writeback once and then counts the pages clean, so a later flush that succeeds proves
nothing about them.
It loses their segment too: replay stops at the first record that is not whole, so the
records after them go to a new segment, where a later flush makes them replayable.

What a crash of a *process* loses is nothing: its files are in the kernel's page cache.
A crash of the *machine* may lose any file written since the file system last flushed,
so every log is tagged with the boot it was written in (``/proc/sys/kernel/random/
boot_id``), and the first store to open the folder after a reboot replays the logs of
earlier boots (``recover``): for each key, the change with the latest timestamp is made
again, the file system is flushed, and the logs are removed.

Timestamps are ``CLOCK_MONOTONIC`` read under the key's lock right after the change: one
clock for every process of a boot, so per key they order the changes as they were made,
whichever processes made them.

A log does not grow for ever. When its segment is full, or has held records for
``CHECKPOINT_AFTER_S``, the process starts a new segment and, in the background, flushes
the whole file system (``syncfs``) and records the time it started as the boot's
*checkpoint mark*: every change timestamped before the mark is on disk. The age is
watched by a thread of the log's own (``_age_out``), not by the next append: that
append was the first write after a quiet spell (the usual webhook of a session that
waited hours), and its own flush then queued behind the checkpoint's ``syncfs`` of all
written meanwhile and the new spare's flush (a write took 3.5 ms instead of 1.2 with
2,000 files dirty here; ``bench/tails.py`` found both beside the slowest webhooks).
Replay skips records before the mark (a later change of the same key by another
process, made durable by the checkpoint, must not be overwritten by an older record from
a log still open), and the segments that hold nothing after it are removed: the
process's own retired ones, and those of processes that have exited (the lock each holds
on its segment is gone). A checkpoint whose flush fails leaves ``failed-<boot>`` beside
the marks: a later flush that succeeds proves nothing about what the failed one lost, so
from then on no checkpoint of that boot moves its mark or removes a log. The logs then
grow until a reboot replays them: the log says so once (``not_checkpointing``, which the
store's health reports), not at every checkpoint. Every log's ager also looks for that
file at each of its looks: a process that has not written since another one's flush
failed runs no checkpoint to find it, and its health would stay clean while the folder
no longer checkpoints.

A change too large to log whole (``RECORD_MAX_BYTES``) is flushed in place, file and
folder, and logged as ``DURABLE``: at replay it overrides older records of its key and
writes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from storage.wal_checkpoints import CHECKPOINT_AFTER_S, _age_s
from storage.wal_marks import (
    _failed_file,
    _folder_lock,
    _mark_file,
    _write_mark,
    boot_id,
    failure_recorded,
    forget_earlier_failures,
    fsync_dir,
    read_mark,
    record_failure,
    syncfs,
)
from storage.wal_records import _BODY, _FRAME, _SUFFIX, Op, Record, _Segment, decode, encode
from storage.wal_segments import _THREAD, LogSegments
from torpor.faults import CrashPoint, crash_point
from torpor.logs import Repeated

log = logging.getLogger(__name__)

# How long the ager holds the log between looks: a log nothing else holds any more is
# collected within this (a closed one is let go at once), and another process's failed
# checkpoint (``failed-<boot>``) is known here within this too, as is any other failed
# flush the log was asked to look for (``watch``).
AGE_POLL_S = 1.0
RECORD_MAX_BYTES = 1 << 20

__all__ = [
    "AGE_POLL_S",
    "RECORD_MAX_BYTES",
    "_BODY",
    "_FRAME",
    "_SUFFIX",
    "Op",
    "Record",
    "Replayed",
    "WriteAheadLog",
    "_Segment",
    "boot_id",
    "decode",
    "encode",
    "failure_recorded",
    "forget_earlier_failures",
    "fsync_dir",
    "own_thread",
    "read_mark",
    "record_failure",
    "recover",
    "syncfs",
]


class WriteAheadLog(LogSegments):
    """One process's log in ``folder``. ``append`` under the key's lock, right after the
    change; ``sync`` before acknowledging it. Thread-safe: concurrent ``sync``s share one
    flush (a group commit). ``flush`` is the call that makes a segment durable
    (``os.fdatasync``; the store times it)."""

    def __init__(
        self,
        folder: str,
        *,
        boot: str | None = None,
        flush: Callable[[int], None] = os.fdatasync,
    ) -> None:
        self.folder = folder
        self.boot = boot if boot is not None else boot_id()
        self._flush = flush
        # Other looks of the ager's (``watch``); kept by a forked child, whose ager calls
        # them again once it runs.
        self._watched: list[Callable[[], object]] = []
        os.makedirs(folder, exist_ok=True)
        self._reset()
        with self._lock:  # now, not at the first append: it also watches for ``failed-<boot>``
            self._start_ager()
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def _start_ager(self) -> None:
        """The log's ager, unless it runs (the lock is held): started with the log, and
        again in a forked child's first ``_next`` (the parent's threads are not its)."""
        if self._ager is None:
            ager = threading.Thread(
                target=_age_out, args=(weakref.ref(self),), name=f"{_THREAD}-age", daemon=True
            )
            ager.start()
            self._ager = ager

    def _age_once(self) -> bool:
        """One look at the segment's age (blocks up to ``AGE_POLL_S``): retired, and the
        next one put in its place, once it has held records for ``CHECKPOINT_AFTER_S``.
        False once the log is closed (a forked child starts an ager of its own)."""
        with self._lock:
            if self._closed:
                return False
            segment = self._segment
            if segment is None or segment.first_at is None:
                self._aged.wait(AGE_POLL_S)
                return True
            left = segment.first_at + CHECKPOINT_AFTER_S - time.monotonic()
            if left > 0 and not segment.failed:  # a failed one is retired at once
                self._aged.wait(min(left, AGE_POLL_S))
                return True
            while self._syncing:  # its descriptor is being flushed: retired after that
                self._synced_cv.wait()
            if self._closed or self._segment is not segment:
                return not self._closed  # closed, or switched meanwhile: look again
            self._retire(segment)
            # The next segment now, in the quiet: the spare, and another made ready.
            self._segment = self._next(0)
            return True


def own_thread() -> bool:
    """Whether the caller runs on one of a log's own threads (checkpoint, spare, ager),
    which may hold its log's lock."""
    return threading.current_thread().name.startswith(_THREAD)


def _forked(ref: weakref.ref[WriteAheadLog]) -> None:
    """In a forked child: the parent's segments, spare and locks are not this process's
    (closing the copies of their descriptors leaves the parent's flocks in place)."""
    log_ = ref()
    if log_ is None:
        return
    for segment in [log_._segment, log_._spare, *log_._retired]:
        if segment is not None:
            with contextlib.suppress(OSError):
                os.close(segment.fd)
    log_._reset()


def _age_out(ref: weakref.ref[WriteAheadLog]) -> None:
    """The ager: a thread per log, which holds it only while it looks (a log no one
    else holds is collected), and ends with it. Each look also learns of another
    process's failed checkpoint (``_look_for_failure``)."""
    failing: Repeated | None = None  # made at the first failure: the folder names it
    while True:
        log_ = ref()
        if log_ is None:
            return
        log_._look_for_failure()  # a stat, until it finds the file (never raises)
        try:
            if not log_._age_once():
                return
        except Exception:  # a flush that failed (its tickets are lost: ``sync`` says so),
            # or a segment it could not open (the next append opens one): try again later
            # (once a second; on a disk that stays broken, a line a minute says so)
            if failing is None:
                failing = Repeated(
                    log,
                    f"could not retire an aged log segment or put the next in place in"
                    f" {log_.folder}",
                )
            failing.failed()
            time.sleep(AGE_POLL_S)
        else:
            # Works again only once a segment is in place: a look that found none (the
            # next one could not be opened) and only waited has proven nothing.
            if failing is not None and log_._segment is not None:
                failing.succeeded()
        del log_


@dataclass(frozen=True)
class Replayed:
    segments: int
    changes: int


def recover(
    folder: str, *, boot: str | None = None, apply: Callable[[Record], None], flush_root: str
) -> Replayed:
    """Replay the logs of earlier boots into the store (``apply`` makes one change,
    without flushing it), flush ``flush_root``'s file system, and remove those logs.
    Serialized between processes; a store that finds nothing to replay pays one listing."""
    boot = boot if boot is not None else boot_id()
    os.makedirs(folder, exist_ok=True)
    if not any(name.endswith(_SUFFIX) for name in os.listdir(folder)):
        return Replayed(0, 0)
    with _folder_lock(folder, ".recover.lock"):
        earlier: list[tuple[float, str, str, bytes]] = []  # (created, boot, path, content)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(_SUFFIX):
                continue
            path = f"{folder}/{name}"
            try:
                with open(path, "rb") as fh:
                    first = next(decode(fh.read(4096)), None)
            except FileNotFoundError:
                # Gone since the listing: a log of this boot its store retired (a live
                # writer's own, never replayed here), or one an earlier recovery replayed
                # and removed before this one took the lock.
                continue
            if first is None or first.op is not Op.HEADER:
                # Created but never written whole: nothing in it was acknowledged.
                with contextlib.suppress(FileNotFoundError):  # or gone meanwhile, as above
                    if _age_s(path) > CHECKPOINT_AFTER_S:
                        os.unlink(path)
                continue
            if first.key == boot:
                continue
            created = float(json.loads(first.data).get("created", 0.0))
            try:
                with open(path, "rb") as fh:
                    earlier.append((created, first.key, path, fh.read()))
            except FileNotFoundError:  # gone since its first read, as above
                continue
        if not earlier:
            return Replayed(0, 0)
        # Boots in the order they ran (the first segment each created), records of one
        # boot by timestamp: the last change of each key wins.
        boot_order: dict[str, float] = {}
        for created, old_boot, _, _ in earlier:
            boot_order[old_boot] = min(created, boot_order.get(old_boot, created))
        marks = {b: read_mark(folder, b) for b in boot_order}
        latest: dict[str, tuple[float, int, Record]] = {}
        for _, old_boot, _, content in earlier:
            for record in decode(content):
                if record.op is Op.HEADER or record.at_ns <= marks[old_boot]:
                    continue
                order = (boot_order[old_boot], record.at_ns)
                seen = latest.get(record.key)
                if seen is None or order > seen[:2]:
                    latest[record.key] = (*order, record)
        # In the order they were made, not the order their keys were first met (segments
        # are read by name, one process's after another's): ``a`` removed, then ``a/b``
        # put by a process whose segment sorts first, with the removal lost on disk,
        # would otherwise meet the file ``a`` in its way, and fail every open after.
        for _, _, record in sorted(latest.values(), key=lambda seen: seen[:2]):
            if record.op is not Op.DURABLE:
                apply(record)
        fd = os.open(flush_root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            syncfs(fd)
        finally:
            os.close(fd)
        # Everything the old boots logged is on disk now: their marks say so before any
        # log goes. Removed one by one, a log holding a key's last change could go before
        # one holding an older change of it, which a recovery killed (or a power cut)
        # in between would then replay over the newer content.
        for old_boot, newest in _newest(earlier).items():
            if newest > marks[old_boot]:
                _write_mark(folder, old_boot, newest)
        for _, _, path, _ in earlier:
            with contextlib.suppress(FileNotFoundError):  # its own store removed it meanwhile
                os.unlink(path)
            crash_point(CrashPoint.STORE_REPLAY_REMOVING)
        # The logs' removal on disk before the marks': a file system without a journal
        # writes a folder's changes back in any order, and a power cut could otherwise
        # keep a mark's removal and not that of a log it covers, which the next replay
        # would then make again over newer content.
        fsync_dir(folder)
        for old_boot in boot_order:
            for done in (_mark_file(folder, old_boot), _failed_file(folder, old_boot)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(done)
        fsync_dir(folder)
        log.warning(
            "replayed %d changes from %d write-ahead log segments of an earlier boot in %s",
            len(latest),
            len(earlier),
            folder,
        )
        return Replayed(len(earlier), len(latest))


def _newest(earlier: list[tuple[float, str, str, bytes]]) -> dict[str, int]:
    """The latest timestamp each boot's segments hold (created, boot, path, content)."""
    newest: dict[str, int] = {}
    for _, old_boot, _, content in earlier:
        for record in decode(content):
            newest[old_boot] = max(record.at_ns, newest.get(old_boot, 0))
    return newest
