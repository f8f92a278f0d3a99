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
import ctypes
import errno
import fcntl
import functools
import json
import logging
import os
import secrets
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

from torpor.faults import CrashPoint, crash_point
from torpor.logs import Repeated

log = logging.getLogger(__name__)

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
# A process's first segment is small (a test's store writes a few objects); each next
# one is sized after what the last one held, up to SEGMENT_MAX_BYTES.
SEGMENT_MIN_BYTES = 1 << 20
SEGMENT_MAX_BYTES = 64 << 20
CHECKPOINT_AFTER_S = 30.0
# How long the ager holds the log between looks: a log nothing else holds any more is
# collected within this (a closed one is let go at once), and another process's failed
# checkpoint (``failed-<boot>``) is known here within this too, as is any other failed
# flush the log was asked to look for (``watch``).
AGE_POLL_S = 1.0
RECORD_MAX_BYTES = 1 << 20
_SUFFIX = ".log"
_THREAD = "torpor-wal"  # the prefix of every thread a log starts (``own_thread``)
_FRAME = struct.Struct("<II")  # the body's length, its CRC-32
_BODY = struct.Struct("<QBH")  # timestamp (ns, CLOCK_MONOTONIC), op, key length


class Op(IntEnum):
    HEADER = 0  # a segment's first record: key = the boot id, data = JSON (pid, created)
    PUT = 1  # the object's whole content
    DELETE = 2
    DURABLE = 3  # flushed in place: nothing to write back, but it overrides older records


@dataclass(frozen=True)
class Record:
    at_ns: int
    op: Op
    key: str
    data: bytes = b""


def encode(record: Record) -> bytes:
    key = record.key.encode()
    body = _BODY.pack(record.at_ns, record.op, len(key)) + key + record.data
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def decode(buf: bytes | memoryview) -> Iterator[Record]:
    """The records of a segment, in order, up to the first that is not whole: the rest of
    a preallocated segment reads as zeros, and a record torn by a crash fails its CRC."""
    view, at = memoryview(buf), 0
    while at + _FRAME.size <= len(view):
        length, crc = _FRAME.unpack_from(view, at)
        body = view[at + _FRAME.size : at + _FRAME.size + length]
        if length < _BODY.size or len(body) < length or zlib.crc32(body) != crc:
            return
        at_ns, op, key_len = _BODY.unpack_from(body)
        try:
            key = bytes(body[_BODY.size : _BODY.size + key_len]).decode()
            kind = Op(op)
        except (UnicodeDecodeError, ValueError):
            return
        yield Record(at_ns, kind, key, bytes(body[_BODY.size + key_len :]))
        at += _FRAME.size + length


def boot_id() -> str:
    try:
        with open(BOOT_ID_FILE) as fh:
            return fh.read().strip()
    except OSError:  # not Linux: no reboot can be told apart, so every log is this boot's
        return "unknown"


def syncfs(fd: int) -> None:
    """Flush the whole file system ``fd`` is on: one call, not one per file."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, "syncfs", None) is None:
        os.sync()
        return
    if libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mark_file(folder: str, boot: str) -> str:
    return f"{folder}/mark-{boot}"


def read_mark(folder: str, boot: str) -> int:
    """The boot's checkpoint mark: every change timestamped before it is on disk."""
    try:
        with open(_mark_file(folder, boot)) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


class CheckpointRefused(OSError):
    """A checkpoint that wrote no mark and removed no log: a flush of the file system
    failed earlier in this boot (``reason`` says which, where this process saw it)."""

    def __init__(self, folder: str, reason: str) -> None:
        super().__init__(errno.EIO, reason, folder)
        self.reason = reason


_FAILED_PREFIX = "failed-"


def _failed_file(folder: str, boot: str) -> str:
    return f"{folder}/{_FAILED_PREFIX}{boot}"


def record_failure(folder: str, boot: str) -> None:
    """Say, durably, that a flush of what ``folder`` holds failed in ``boot``: no later
    flush of the boot, in any process, may vouch for what it covered (best effort: the
    disk is failing). Seen by other processes as soon as the name is made, before the
    folder's flush: they look for it with ``failure_recorded``. Here, a checkpoint's flush
    of the file system; in ``storage.small_objects``, a flush of its table's log."""
    with contextlib.suppress(OSError):
        os.close(os.open(_failed_file(folder, boot), os.O_WRONLY | os.O_CREAT, 0o600))
        fsync_dir(folder)


def failure_recorded(folder: str, boot: str) -> bool:
    """Whether a flush of what ``folder`` holds failed in ``boot``, in any process
    (``record_failure``): one stat. A reboot's page cache holds none of the pages a
    failed writeback dropped, so another boot's failure is not looked for."""
    return os.path.exists(_failed_file(folder, boot))


def forget_earlier_failures(folder: str, boot: str) -> None:
    """Remove the markers (``record_failure``) of every boot but ``boot``: what their
    failed flushes dropped went with their page cache, and nothing looks for them again.
    Never raises (a marker left is looked for by no one); a removal a power cut undoes
    is made again by the next call."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    mine = os.path.basename(_failed_file(folder, boot))
    for name in names:
        if name.startswith(_FAILED_PREFIX) and name != mine:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _write_mark(folder: str, boot: str, mark: int) -> None:
    """Set the boot's checkpoint mark to ``mark``, durably (in place of the old one)."""
    path = _mark_file(folder, boot)
    tmp = f"{path}.{secrets.token_hex(4)}"
    with open(tmp, "w") as fh:
        fh.write(str(mark))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """A folder's entries (names made, renamed, removed) flushed to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _folder_lock(folder: str, name: str) -> Iterator[None]:
    fd = os.open(f"{folder}/{name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class _Segment:
    path: str
    fd: int
    size: int
    used: int
    first_at: float | None = None  # CLOCK_MONOTONIC s of its first record after the header
    # A flush of it failed: nothing more is appended to it. Replay stops at the first
    # record that is not whole, and the records that flush covered may read as zeros
    # after a power cut, so a record after them, flushed later, would be acknowledged
    # and then never replayed.
    failed: bool = False


class WriteAheadLog:
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

    def _start_ager(self) -> None:
        """The log's ager, unless it runs (the lock is held): started with the log, and
        again in a forked child's first ``_next`` (the parent's threads are not its)."""
        if self._ager is None:
            ager = threading.Thread(
                target=_age_out, args=(weakref.ref(self),), name=f"{_THREAD}-age", daemon=True
            )
            ager.start()
            self._ager = ager

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


def _overdue(segment: _Segment) -> bool:
    """Held records for twice ``CHECKPOINT_AFTER_S``: the ager should have retired it
    (it is stuck, or it failed), so the append that finds it does."""
    return (
        segment.first_at is not None
        and time.monotonic() - segment.first_at > 2 * CHECKPOINT_AFTER_S
    )


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


def _discard(segment: _Segment) -> None:
    """Remove a segment nothing was appended to."""
    with contextlib.suppress(OSError):
        os.unlink(segment.path)
    with contextlib.suppress(OSError):
        os.close(segment.fd)


def _header(fd: int) -> str | None:
    """The boot a segment was written in, or None if its header is not whole."""
    first = next(decode(os.pread(fd, 4096, 0)), None)
    return first.key if first is not None and first.op is Op.HEADER else None


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


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0
