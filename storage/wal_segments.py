"""The write-ahead log's segments (``storage.wal``): a change appended to the current
one, flushed for a group of callers at once (``sync``), the records a failed flush lost
refused for good; the segment switched for a spare made ready in the background when it
is full or old, retired (flushed, then left to a checkpoint), released or closed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from storage.wal_checkpoints import CHECKPOINT_AFTER_S, LogCheckpoints
from storage.wal_marks import fsync_dir
from storage.wal_records import _SUFFIX, Op, Record, _Segment, encode

log = logging.getLogger(__name__)

# A process's first segment is small (a test's store writes a few objects); each next
# one is sized after what the last one held, up to SEGMENT_MAX_BYTES.
SEGMENT_MIN_BYTES = 1 << 20
SEGMENT_MAX_BYTES = 64 << 20
_THREAD = "torpor-wal"  # the prefix of every thread a log starts (``own_thread``)


class LogSegments(LogCheckpoints):
    """A log's segments and the tickets of its records (``WriteAheadLog``, which starts
    the ager: ``_start_ager``)."""

    _flush: Callable[[int], None]
    _start_ager: Callable[[], None]

    def _reset(self) -> None:
        # New locks too: in a forked child another thread of the parent may have held
        # these (a flush under the lock), and no thread of the child would release them.
        self._lock = threading.Lock()
        self._synced_cv = threading.Condition(self._lock)
        self._failed: OSError | None = None  # a flush ``release`` could not make
        # Tickets a failed flush covered: (after, upto, error). Linux reports a failed
        # writeback once and then drops the pages' dirty state, so a later flush that
        # succeeds proves nothing about them: they are never reported durable.
        self._lost: list[tuple[int, int, OSError]] = []
        self._segment: _Segment | None = None
        self._spare: _Segment | None = None  # the next segment, made ready in the background
        self._preparing = False
        self._closed = False
        self._retired: list[_Segment] = []
        self._aged = threading.Condition(self._lock)  # the ager's wait, cut short by close
        self._ager: threading.Thread | None = None
        self._appended = 0  # tickets: one per record, across segments
        self._synced = 0
        self._syncing = False
        self._checkpointing = False
        # Why no checkpoint of this boot may move the mark or remove a log (a flush of
        # the file system failed), once this process knows: for the store's health.
        self.not_checkpointing: str | None = None
        # Orders the ager's look at ``failed-<boot>`` with a checkpoint's own failure (whose
        # reason must not be taken for another process's), and says it once (``_said``).
        self._told = threading.Lock()
        self._said = False
        self._next_size = SEGMENT_MIN_BYTES
        self._pid = os.getpid()

    # -- appending ---------------------------------------------------------------------

    def append(self, op: Op, key: str, data: bytes = b"", *, after: int = 0) -> int:
        """Log a change just made (the caller holds the key's lock); a ticket for
        ``sync``. ``after``: a record this one rests on (a staged snapshot, for the
        removal of its session's live marker); if a failed flush lost it, this one is
        refused (the error raised), so no replay makes this change without that one.
        It need not be flushed yet: a record is replayed only with every record before
        it in its segment, and one left in an earlier segment was flushed when that
        segment was retired, or lost (``_Segment.failed``)."""
        at_ns = time.monotonic_ns()  # under the key's lock: orders this key's changes
        frame = encode(Record(at_ns, op, key, data))
        with self._lock:
            segment = self._writable(len(frame))
            # Only now: finding a segment may wait for a flush (the lock let go), and that
            # flush may be the one that fails and loses ``after``.
            lost = self._lost_by(after) if after else None
            if lost is not None:
                raise lost
            if segment.first_at is None:  # the ager counts its age from here
                segment.first_at = time.monotonic()
            view = memoryview(frame)
            while view:  # a short write would leave a gap that ends the log at replay
                view = view[os.pwrite(segment.fd, view, segment.used + len(frame) - len(view)) :]
            segment.used += len(frame)
            self._appended += 1
            return self._appended

    def synced(self, ticket: int) -> bool:
        """Whether the record ``ticket`` names is durable already (no lock: one read of
        an int that only grows, and of a list that is empty unless a flush failed)."""
        return self._synced >= ticket and self._lost_by(ticket) is None

    def sync(self, ticket: int) -> None:
        """Return once the record ``ticket`` names is durable: the first caller flushes
        for everyone who appended before it started; the others wait for that flush.
        Raises the error of a failed flush that covered it, however often it is asked."""
        with self._synced_cv:
            while True:
                lost = self._lost_by(ticket)
                if lost is not None:
                    raise lost
                if self._synced >= ticket:
                    return
                if self._syncing:
                    self._synced_cv.wait()
                    continue
                segment, target = self._segment, self._appended
                if segment is None:  # released: its last flush failed (or it would be synced)
                    raise self._failed or OSError(errno.EIO, "log released unflushed")
                self._syncing = True
                self._lock.release()
                failed: OSError | None = None
                try:
                    self._flush(segment.fd)
                except OSError as exc:
                    failed = exc
                finally:
                    self._lock.acquire()
                    self._syncing = False
                    self._synced_cv.notify_all()
                if failed is not None:
                    # Lost with it: what was appended while it ran, after the records
                    # it covered, in the same segment (see ``_Segment.failed``).
                    self._lose(self._appended, failed)
                    segment.failed = True
                    raise failed
                self._synced = max(self._synced, target)

    def _lose(self, upto: int, exc: OSError) -> None:
        """A flush failed (the lock is held): the tickets it covered are lost for good.
        One entry per range: on a disk that stays broken the ager and every append retry
        the same failed segment's flush, and ``_lost_by`` reads the list on each sync."""
        if upto > self._synced and not (self._lost and self._lost[-1][:2] == (self._synced, upto)):
            self._lost.append((self._synced, upto, exc))

    def _lost_by(self, ticket: int) -> OSError | None:
        """The error of a failed flush that covered ``ticket`` (the list is empty unless
        one failed: one truth test on every ``synced``)."""
        if not self._lost:
            return None
        return next((exc for after, upto, exc in self._lost if after < ticket <= upto), None)

    def ready(self) -> None:
        """Put the first segment in place now, not in the first append (a store getting
        ready for traffic); its spare is then made on a thread of the log's. A segment
        nothing is appended to is removed when the log is closed."""
        with self._lock:
            if self._segment is None and not self._closed:
                self._segment = self._next(0)

    def _writable(self, need: int) -> _Segment:
        """The segment to append ``need`` bytes to (the lock is held): a new one when
        there is none yet, it is full, or the ager has let it grow old (``_overdue``)."""
        while True:
            segment = self._segment
            if segment is None:
                segment = self._segment = self._next(need)
                return segment
            if segment.used + need <= segment.size and not _overdue(segment) and not segment.failed:
                return segment
            if self._syncing:  # its descriptor is being flushed: retired after that
                self._synced_cv.wait()
                continue
            self._retire(segment)

    def _next(self, need: int) -> _Segment:
        """The segment to switch to (the lock is held): the spare, if one is ready and
        large enough (a switch then costs no flush on the caller's thread), else a new
        one; either way a spare is prepared for the switch after this one."""
        # A forked child's ager: first, as a thread that cannot start has taken nothing.
        self._start_ager()
        spare, self._spare = self._spare, None
        if spare is not None and spare.size - spare.used >= need:
            segment = spare
        else:
            if spare is not None:  # too small for this record: never written to
                _discard(spare)
            segment = self._open(max(self._next_size, need + 4096))
        if not self._preparing:
            self._preparing = True
            threading.Thread(target=self._prepare, name=f"{_THREAD}-spare", daemon=True).start()
        return segment

    def _prepare(self) -> None:
        spare: _Segment | None = None
        try:
            spare = self._open(self._next_size)
        except Exception:  # the next switch opens its segment itself
            log.warning("could not prepare a log segment in %s", self.folder, exc_info=True)
        with self._lock:
            self._preparing = False
            if spare is not None and self._spare is None and not self._closed:
                self._spare, spare = spare, None
        if spare is not None:
            _discard(spare)

    def _open(self, size: int) -> _Segment:
        header = encode(
            Record(
                time.monotonic_ns(),
                Op.HEADER,
                self.boot,
                json.dumps({"pid": os.getpid(), "created": time.time()}).encode(),
            )
        )
        size = max(size, len(header))
        path = f"{self.folder}/{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}{_SUFFIX}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held while we live: how others tell we exited
            # Allocated now, so that appending never changes the file's size: a flush of
            # the data alone (fdatasync) then makes a record durable.
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, header, 0)
            os.fsync(fd)
            fsync_dir(self.folder)  # the segment itself survives a power cut
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return _Segment(path, fd, size, len(header))

    def _retire(self, segment: _Segment) -> None:
        """Stop appending to ``segment`` (the lock is held): flushed now, so every ticket
        on it is durable, and removed by the next checkpoint."""
        try:
            # Of a failed segment too: it proves nothing about the records it lost, but
            # a disk that fails it still is not written to anew (the ager retries).
            self._flush(segment.fd)
        except OSError as exc:
            self._lose(self._appended, exc)
            segment.failed = True
            raise
        self._synced = self._appended
        self._segment = None
        self._retired.append(segment)
        self._next_size = min(SEGMENT_MAX_BYTES, max(SEGMENT_MIN_BYTES, 2 * segment.used))
        if not self._checkpointing:
            self._checkpointing = True
            threading.Thread(target=self._checkpoint, name=_THREAD, daemon=True).start()

    def release(self) -> None:
        """Give the descriptors back, without a checkpoint: the segment, flushed, is left
        to the next checkpoint of any process of this boot (its lock went with its
        descriptor: it reads as an exited process's) or to a replay after a reboot."""
        if self._pid != os.getpid():
            return  # a forked child's copy: the segments are the parent's
        with self._synced_cv:
            while self._syncing:
                self._synced_cv.wait()
            self._closed = True
            self._aged.notify_all()
            empty = self._unwritten()
            segment, self._segment = self._segment, None
            spare, self._spare = self._spare, None
            if segment is not None:
                try:
                    self._flush(segment.fd)
                except OSError as exc:  # the records not yet synced are not durable: say so
                    self._failed = exc
                    self._lose(self._appended, exc)
                else:
                    self._synced = self._appended
        if segment is not None:
            with contextlib.suppress(OSError):
                os.close(segment.fd)
        for unused in (empty, spare):
            if unused is not None:
                _discard(unused)

    def close(self) -> None:
        """Retire the segment (a checkpoint removes it) and remove the spare."""
        if self._pid != os.getpid():
            return  # a forked child's copy: the segments are the parent's
        with self._synced_cv:
            while self._syncing:  # its descriptor is being flushed
                self._synced_cv.wait()
            self._closed = True
            self._aged.notify_all()
            empty = self._unwritten()
            if self._segment is not None:
                self._retire(self._segment)
            spare, self._spare = self._spare, None
        for unused in (empty, spare):
            if unused is not None:
                _discard(unused)

    def _unwritten(self) -> _Segment | None:
        """The current segment taken away if nothing was ever appended to it (the lock is
        held): one the ager put in place, to discard rather than flush or checkpoint."""
        segment = self._segment
        if segment is None or segment.first_at is not None:
            return None
        self._segment = None
        return segment


def _overdue(segment: _Segment) -> bool:
    """Held records for twice ``CHECKPOINT_AFTER_S``: the ager should have retired it
    (it is stuck, or it failed), so the append that finds it does."""
    return (
        segment.first_at is not None
        and time.monotonic() - segment.first_at > 2 * CHECKPOINT_AFTER_S
    )


def _discard(segment: _Segment) -> None:
    """Remove a segment nothing was appended to."""
    with contextlib.suppress(OSError):
        os.unlink(segment.path)
    with contextlib.suppress(OSError):
        os.close(segment.fd)
