"""``file:///path``: the embedded object store, one folder on one host.

It gives the same create-only and compare-and-swap semantics as S3 to every process on
the host:

* ``put_if_absent`` writes a temporary file and moves it into place with
  ``renameat2(RENAME_NOREPLACE)`` (``_place_new``): it fails with EEXIST if the key
  exists, so exactly one creator wins (the key's lock is held
  only to log the change in order with the key's other changes). The
  creates waiting in one event loop are handed to a worker thread together
  (``_create_all``): one hop for all of them (0.08 ms of CPU per create, was 0.37).
* ``put_if_match``, ``delete`` and ``delete_if_match`` take an exclusive ``flock`` on a
  per-key lock file, compare the current etag and swap the new content in, or the object
  out (``_swap_in``: the old file is kept to be recycled, ``storage.blanks``): readers
  never see a half-written file, two writers never both pass the etag check, and a
  reader checks after its read that the key still names the file it read
  (``_unchanged``).

The objects every webhook creates (its inbox event, its replay marker) are not files:
they are rows of one SQLite table in ``.small`` (``storage.small_objects``), chosen by
key prefix, with the same semantics; a listing that spans both kinds merges them.

Etags are the MD5 of the content, as S3 computes them for single-part uploads.
Blocking file I/O runs in worker threads of the store's own so the caller's event loop
keeps serving; the exceptions are a whole read of a small object (``_read_small``) and
the listing of a small flat folder (``_list_small``), cheaper on the caller's thread
than the hop, and a write made while nothing else of the store's is in flight
(``_Inline``): one at a time, the hop to a worker thread and back wakes two sleeping
threads, which after an idle gap cost about as much as the flush itself (README, "Speed
(0.4)", fifth pass). A write waits for no lock on the caller's thread: a key another
process holds goes to a worker thread, and so do all writes while recent flushes were
slow or inline writes have had their share of the loop's time. A disk that stalls
without warning holds the loop for the first inline write caught in it.

Every durable change is logged (``storage.wal``): the object's file is written and its
bytes flushed (``_written``: a rename the disk keeps must never name bytes it lost; files
written together start their writeback together), it is renamed into place, the change
is appended to this process's write-ahead log under the key's lock, and one
``fdatasync`` of the log makes the rename durable, shared by every change logged
meanwhile; a change is acknowledged only after that flush, and the first store to open
the folder after a reboot replays what the file system may have lost. Removals are
logged (and so durable) too. An object larger than ``wal.RECORD_MAX_BYTES`` is flushed
in place instead. A create can be staged (``stage_if_absent``): in place and logged, its
flush awaited later, so that a webhook's inbox event and its audit record, whose verdict
depends on whether the event was new, share one flush. A create its writer marks as
not ``durable`` (the replay marker: ``storage.inbox`` says what a power cut that takes
it lets through) is neither flushed nor logged. (One ``syncfs`` per group of creates
was tried: it flushes everyone's dirty data on the file system, Ray's logs included,
and cost 1.6 ms of kernel CPU per webhook against 0.09 ms; the log's checkpoints call
it once per segment or per 30 s.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import os
import stat
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, ParamSpec, TypeVar

from storage import blanks, cursors, folder_pages, small_objects, wal
from storage.keys import check_object_key
from storage.loop_batches import LoopBatches, forget_when_done
from torpor.errors import (
    ConfigError,
    EtagMismatch,
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
    StorageUnavailable,
)
from torpor.faults import CrashPoint, crash_point
from torpor.ports import ListPage, Staged, StoredObject, already_durable

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")

_LOCKS = ".locks"
_TMP = ".tmp"
_WAL = ".wal"
_SMALL = ".small"
# One pool per process, shared by every store in it (threads are started as needed).
WRITER_THREADS = 32
CREATES_AT_ONCE = 64
INLINE_READ_BYTES = 64 * 1024
# A read that finds its key changed under it (``_unchanged``) reads the key again, at most
# this many times in all: each retry needs another write to land inside the read.
READ_ATTEMPTS = 5
LOCK_STRIPES = 64
INLINE_LIST_ENTRIES = 256
# A write is made on the caller's thread only while flushes take less than this (a
# moving average): above it, the event loop would stall for the disk.
INLINE_FLUSH_BUDGET_S = 0.002
# ... and while writes made there have taken at most this share of the loop's time (a
# burst of INLINE_BURST_S aside): under load the loop has other work to do meanwhile,
# and the worker threads flush while it does it.
INLINE_SHARE = 0.25
INLINE_BURST_S = 0.005
_THREADS: dict[int, ThreadPoolExecutor] = {}
# What opening a key's path raises when no object is there: nothing at it, a file where
# one of its folders would be ("a/b" when "a" is an object), or a folder at it ("q" when
# "q/w" is). No key names a folder, so the last is missing too, to a read.
_NO_OBJECT = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
# key, body, and whether the caller stages it (``stage_if_absent``).
_Create = tuple[str, bytes, bool]
# A small object's create (``storage.small_objects``): key, body, etag.
_RowCreate = tuple[str, bytes, str]
# (Inside the class, ``list`` names its method.)
_Creates = list[_Create]
_Created = list[tuple[str, int] | Exception]  # each one's etag and log ticket, or error
_RowCreates = list[_RowCreate]
_RowsCreated = list[int | Exception]  # each one's commit ticket, or error
_Keys = list[str]


def _threads() -> ThreadPoolExecutor:
    # Keyed by process: a forked child must not inherit a pool whose threads it lacks.
    pid = os.getpid()
    if pid not in _THREADS:
        _THREADS.clear()
        _THREADS[pid] = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="torpor-files")
    return _THREADS[pid]


def etag_of(data: bytes) -> str:
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


def _normal(etag: str) -> str:
    return etag.strip('"')


class _Contended(Exception):
    """A key's lock is held elsewhere: the write is not made on the caller's thread."""


class _Inline:
    """Whether a write may be made on the caller's thread: nothing else of the store's
    is in a worker thread, flushes have been quick (a moving average of their durations,
    fed by every flush, inline or not), and writes made there have not taken more than
    their share of the loop's time (a leaky bucket of the time they took)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.flush_s = 0.0
        self._spent_s = 0.0
        self._at = time.perf_counter()

    def allows(self, size: int) -> bool:
        """Whether a write of ``size`` bytes may be made on the caller's thread now."""
        if size > INLINE_READ_BYTES or self.in_flight or self.flush_s >= INLINE_FLUSH_BUDGET_S:
            return False
        now = time.perf_counter()
        self._spent_s = max(0.0, self._spent_s - (now - self._at) * INLINE_SHARE)
        self._at = now
        return self._spent_s < INLINE_BURST_S

    def run(self, write: Callable[[], T]) -> T:
        """``write()`` on the caller's thread, its time charged to the bucket."""
        started = time.perf_counter()
        try:
            return write()
        finally:
            self._spent_s += time.perf_counter() - started

    def flushed(self, fd: int, how: Callable[[int], None] | None = None) -> None:
        """``how(fd)`` (a flush, ``os.fsync`` by default), timed. Worker threads call it
        too: a lost update of the average between two of them only delays its next move."""
        started = time.perf_counter()
        (how or os.fsync)(fd)
        self.flush_s = 0.8 * self.flush_s + 0.2 * (time.perf_counter() - started)

    def log_flushed(self, fd: int) -> None:
        """The write-ahead log's flush: data only, the segment's size never changes."""
        self.flushed(fd, os.fdatasync)


class _Stripes:
    """Per-key locks between processes and threads: ``LOCK_STRIPES`` lock files, each
    key hashed to one. A lock per key was a file per key: a new inode for every object
    ever written (two per webhook). A stripe's file is opened once per process and kept
    open; since ``flock`` does not exclude threads sharing a descriptor, each stripe has
    a thread lock too. Two keys of one stripe wait for each other: the lock is held for
    a rename and a log append, microseconds."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._reset()
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def _reset(self) -> None:
        self._closed = False  # by ``close``: ``open_all`` opens nothing after it
        self._pid = os.getpid()
        self._threads = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self._fds: dict[int, int] = {}

    def close(self) -> None:
        """Close the lock files (reopened if the store is used again), each once no
        thread of ours holds it: closed under a holder, its lock would be lost."""
        if self._pid != os.getpid():
            return
        self._closed = True
        for stripe, thread_lock in enumerate(self._threads):
            with thread_lock:
                fd = self._fds.pop(stripe, None)
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def path(self, key: str) -> str:
        return self._file(self._stripe(key))

    def _file(self, stripe: int) -> str:
        return f"{self.folder}/{stripe:04x}"

    def _opened(self, stripe: int) -> int:
        """The stripe's lock file, opened once per process (its thread lock is held)."""
        fd = self._fds.get(stripe)
        if fd is None:
            fd = self._fds[stripe] = os.open(self._file(stripe), os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    @staticmethod
    def _stripe(key: str) -> int:
        return zlib.crc32(key.encode()) % LOCK_STRIPES

    def open_all(self) -> None:
        """Every stripe's lock file opened now, not by the first write that hashes to it
        (a store getting ready for traffic); none once the stripes were closed."""
        if self._pid != os.getpid():
            self._reset()
        for stripe, thread_lock in enumerate(self._threads):
            with thread_lock:
                if self._closed:
                    return
                self._opened(stripe)

    @contextlib.contextmanager
    def held(self, key: str, *, wait: bool) -> Iterator[None]:
        if self._pid != os.getpid():  # a forked child: the parent's descriptors are shared
            self._reset()
        stripe = self._stripe(key)
        thread_lock = self._threads[stripe]
        if not thread_lock.acquire(blocking=wait):
            raise _Contended(key)
        try:
            fd = self._opened(stripe)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _Contended(key) from None
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            thread_lock.release()

    @contextlib.contextmanager
    def held_both(self, first: str, second: str, *, wait: bool) -> Iterator[None]:
        """Both keys' locks, taken in stripe order (two moves of one pair in opposite
        directions cannot each hold one and wait for the other); once if they share one."""
        a, b = sorted((first, second), key=self._stripe)
        if self._stripe(a) == self._stripe(b):
            with self.held(a, wait=wait):
                yield
            return
        with self.held(a, wait=wait), self.held(b, wait=wait):
            yield


def _forked(ref: weakref.ref[_Stripes]) -> None:
    """In a forked child: its copies of the parent's lock files closed. A ``flock``
    belongs to the open file, which a copy keeps open: a parent killed holding a key's
    lock would otherwise leave it held for as long as the child runs."""
    stripes = ref()
    if stripes is None:
        return
    for fd in stripes._fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    stripes._reset()


class LocalObjectStore:
    @staticmethod
    def objects_in(root: str | Path) -> Path:
        """The folder of a store at ``root`` that holds the objects themselves; the rest
        of ``root`` is the store's own (its log, preallocated, locks and spare files), for
        a measure of what the objects take."""
        return Path(root).expanduser().resolve() / "objects"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._tmp = str(self.root / _TMP)
        # Folders this process knows exist; a folder is never removed, so the cache
        # cannot go stale.
        self._dirs: set[str] = set()
        self._objects = str(self.objects_in(self.root))
        try:
            for sub in (_LOCKS, _TMP):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"local object store {self.root} is not writable: {exc}") from exc
        # Creates asked for together in an event loop, made together (``storage.loop_batches``).
        self._creates: LoopBatches[_Create, tuple[str, int]] = LoopBatches(
            at_once=CREATES_AT_ONCE, failed=_translated
        )
        self._inline = _Inline()
        self._cursors = cursors.Cursors()
        self._locks = _Stripes(str(self.root / _LOCKS))
        # What killed processes left in ``.tmp`` (made-ahead blanks, half-done writes).
        _threads().submit(blanks.sweep, self._tmp, boot=wal.boot_id())
        folder = str(self.root / _WAL)
        boot = wal.boot_id()
        self._blanks = blanks.Blanks(
            self._tmp,
            submit=lambda make: _threads().submit(make),
            # The log's checkpoint mark; nothing that holds the store (its finalizer
            # holds this object: a reference back would keep the store for ever).
            settled=functools.partial(wal.read_mark, folder, boot),
            boot=boot,  # kept files are handed between processes (``spare``)
        )
        self._blank_folders = blanks.Blanks(
            self._tmp, submit=lambda make: _threads().submit(make), folders=True
        )
        try:
            wal.recover(folder, apply=self._replay, flush_root=str(self.root))
        except OSError as exc:
            raise ConfigError(f"local object store {self.root}: log replay failed: {exc}") from exc
        self._log = wal.WriteAheadLog(folder, flush=self._inline.log_flushed, boot=boot)
        # The objects every webhook creates, as rows (``storage.small_objects``): what an
        # older version left as files under their prefixes moved in first, the log's
        # replay included.
        try:
            self._rows = small_objects.SmallObjects(
                str(self.root / _SMALL), flush=self._inline.log_flushed, boot=boot
            )
            self._rows.adopt(self._objects, forget=self._forget)
        except (OSError, StorageUnavailable) as exc:
            raise ConfigError(f"local object store {self.root}: {exc}") from exc
        # Another process's failed flush of the rows' log, learned of by a process that
        # does not write (its flushes look themselves), for its health (``trouble``).
        self._log.watch(self._rows.look_for_failure)
        self._row_creates: LoopBatches[_RowCreate, int] = LoopBatches(
            at_once=CREATES_AT_ONCE, failed=_translated
        )
        self._row_syncs: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Future[None]
        ] = weakref.WeakKeyDictionary()
        # Descriptors held for the store's life (lock files, log segments): given back
        # when it is closed or collected, so that a process that opens many stores (a
        # test run) does not run out of them.
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._locks,
            self._log,
            self._blanks,
            self._blank_folders,
            rows=self._rows,
        )

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def trouble(self) -> str | None:
        """``ReportsTrouble``: why the log no longer checkpoints, if it does not, and why
        the rows' log can no longer be made durable, if it cannot (every inbox event,
        replay marker and audit block is refused from then on: without this the store
        answered its health checks clean while every webhook of the process failed), in
        this process or, within ``wal.AGE_POLL_S``, another of the boot's."""
        found = []
        if (reason := self._log.not_checkpointing) is not None:
            found.append(f"write-ahead log not checkpointing: {reason}")
        if (failed := self._rows.failed_flush) is not None:
            found.append(
                f"small objects' log not durable, every row write refused: a flush failed"
                f" ({failed})"
            )
        return "; ".join(found) or None

    # -- paths ----------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        # A plain string join: pathlib's cost 6.6 us a path here, on every object a
        # webhook reads or writes (the key is checked, so no "..", no absolute part).
        return f"{self._objects}/{check_object_key(key)}"

    def _locked(self, key: str, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        """The key's exclusive lock; without ``wait``, ``_Contended`` if it is held."""
        return self._locks.held(key, wait=wait)

    def _write_tmp(self, data: bytes) -> str:
        """A temporary file holding ``data``, its bytes flushed (``_written``)."""
        (written,) = self._written([data])
        if isinstance(written, BaseException):
            raise written
        return written

    def _written(self, datas: list[bytes]) -> list[str | OSError]:
        """A temporary file holding each of ``datas`` (or the error that stopped it), its
        bytes flushed before it is renamed into place.

        A change is logged only after its rename, and the folder's entries and the
        files' bytes reach the disk in any order (no journal orders them here): a writer
        killed between the rename and its record, then a power cut, would leave a name
        the log can neither redo nor undo, pointing at bytes never written. A replace
        lost the acknowledged object that way once a checkpoint had dropped its record,
        and a create left an empty object where none was acknowledged. Flushed first,
        whatever the disk kept of the rename names whole bytes.

        Several files start their writeback together (``_start_writeback``) before any
        is waited for: 16 flushed one after another took 6.0 ms here, 1.7 ms so."""
        out: list[str | OSError] = []
        opened: list[tuple[int, int]] = []  # (index in out, fd)
        try:
            for data in datas:
                try:
                    tmp, fd = self._open_tmp(data)
                except OSError as exc:
                    out.append(exc)
                    continue
                opened.append((len(out), fd))
                out.append(tmp)
                if len(datas) > 1:
                    _start_writeback(fd)
            for i, fd in opened:
                # A large object's record says it is flushed in place (``DURABLE``): its
                # size, like its bytes, must be on disk (``fsync``). The log has the rest.
                large = len(datas[i]) > wal.RECORD_MAX_BYTES
                try:
                    self._inline.flushed(fd, None if large else os.fdatasync)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(str(out[i]))
                    out[i] = exc
        except BaseException:
            for i, _ in opened:
                if isinstance(out[i], str):
                    with contextlib.suppress(OSError):
                        os.unlink(str(out[i]))
            raise
        finally:
            for _, fd in opened:
                os.close(fd)
        return out

    def _logged(self, key: str, path: str, data: bytes) -> int:
        """Log the change just made to ``key`` (its lock held): its content, or for a
        large object, flushed with its file already, the folder's entry flushed now."""
        if len(data) > wal.RECORD_MAX_BYTES:
            return self._logged_in_place(key, path)
        return self._log.append(wal.Op.PUT, key, data)

    def _logged_in_place(self, key: str, path: str) -> int:
        """Log a large object placed at ``key`` (its lock held), its file flushed when it
        was written: its folder's entry is flushed now, and the record says so.

        So is every folder's above it, up to the store's root: a replay writes nothing
        for a ``DURABLE`` record, and a folder made for the object (``_parent``: renamed
        into place, or ``makedirs``) has an entry in its own parent that nothing else
        flushes before the next checkpoint. Lost to a power cut, it took the
        acknowledged object with it (and a move's removal of the old name, replayed,
        the object itself). Large objects are rare; a clean folder's flush is cheap."""
        folder = os.path.dirname(path)
        while True:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._inline.flushed(fd)
            finally:
                os.close(fd)
            if folder == str(self.root) or not folder.startswith(f"{self.root}/"):
                break
            folder = os.path.dirname(folder)
        return self._log.append(wal.Op.DURABLE, key)

    def _forget(self, keys: list[str]) -> None:
        """Removals of files moved into the table (``SmallObjects.adopt``) logged and
        flushed before the files go: a replay ends on them, not on the file's put."""
        ticket = 0
        for key in keys:
            with self._locked(key):
                ticket = self._log.append(wal.Op.DELETE, key)
        if ticket:
            self._log.sync(ticket)

    def _replay(self, record: wal.Record) -> None:
        """One change from a log of an earlier boot, made again (flushed by the caller)."""
        path = self._file(record.key)
        if record.op is wal.Op.DELETE:
            # Gone already, or its name is objects' folder now (``a`` removed, then
            # ``a/b`` put): no object there either way.
            with contextlib.suppress(*_NO_OBJECT):
                os.unlink(path)
            return
        self._parent(path)
        tmp, fd = self._open_tmp(record.data)
        os.close(fd)
        os.replace(tmp, path)

    def _open_tmp(self, data: bytes) -> tuple[str, int]:
        """A temporary file holding ``data`` (written, not yet durable), still open."""
        blank = self._blanks.take()  # made ready in a worker thread (``storage.blanks``)
        try:
            fd = os.open(blank, os.O_WRONLY) if blank is not None else -1
        except FileNotFoundError:  # removed by hand meanwhile: made here instead
            fd = -1
        if blank is not None and fd >= 0:
            tmp = blank
        else:
            # O_EXCL on a random name: the same guarantee as mkstemp with fewer syscalls
            # (this is on every webhook's path). Named as a blank: swapped out by a
            # replace, it holds the old object's file, kept while this process runs.
            tmp = self._blanks.name()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp, fd

    def _create_all(
        self, items: list[tuple[str, bytes]], wait: bool = True
    ) -> list[str | Exception]:
        """``put_if_absent`` of several objects in one go: every body written, each
        moved into place and logged under its key's lock, then one flush of the log for
        all (an etag, or the error, for each; without ``wait``, ``_Contended`` for a key
        whose lock is held elsewhere)."""
        out, ticket = self._place_all(items, wait)
        try:
            if ticket:
                self._log.sync(ticket)
        except Exception as exc:  # the log could not be flushed: none of them is durable
            out = [exc if isinstance(result, str) else result for result in out]
        return out

    def _place_all(
        self, items: list[tuple[str, bytes]], wait: bool
    ) -> tuple[list[str | Exception], int]:
        """Every body written, each moved into place and logged, none flushed: an etag or
        the error for each, and the log's ticket of the last one placed (0 if none)."""
        out: list[str | Exception] = []
        paths: list[tuple[int, str]] = []  # (item, path)
        for i, (key, data) in enumerate(items):
            try:
                path = self._file(key)
                self._parent(path)
            except Exception as exc:
                out.append(exc)
                continue
            out.append(etag_of(data))
            paths.append((i, path))
        opened: list[tuple[int, str, str]] = []  # (item, path, tmp)
        written = self._written([items[i][1] for i, _ in paths])
        for (i, path), tmp in zip(paths, written, strict=True):
            if isinstance(tmp, str):
                opened.append((i, path, tmp))
            else:
                out[i] = tmp
        ticket = 0
        placed: set[int] = set()
        try:
            for i, path, tmp in opened:
                key, data = items[i]
                try:
                    with self._locked(key, wait=wait):
                        _place_new(tmp, path)
                        placed.add(i)
                        crash_point(CrashPoint.STORE_AFTER_PLACE)
                        ticket = self._logged(key, path, data)
                except FileExistsError:
                    out[i] = _taken(key, path)
                except (OSError, _Contended) as exc:
                    out[i] = exc
        finally:
            for i, _, tmp in opened:
                if i not in placed:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        return out, ticket

    def _parent(self, path: str | Path) -> None:
        parent = os.path.dirname(path)
        if parent in self._dirs:
            return
        if not os.path.isdir(parent):  # a stat: an existing folder costs no made-ahead one
            blank = self._blank_folders.take()
            if blank is None or not _place_folder(blank, parent):
                if blank is not None and os.path.isdir(blank):  # there already, or no parent
                    self._blank_folders.give_back(blank)
                try:
                    os.makedirs(parent, exist_ok=True)
                except (FileExistsError, NotADirectoryError):  # an object's file on the way
                    raise _in_the_way(os.path.relpath(path, self._objects)) from None
        self._dirs.add(parent)

    # -- blocking implementations ---------------------------------------------------

    def _get(self, key: str, max_bytes: int | None) -> StoredObject:
        path = self._file(key)
        for _ in range(READ_ATTEMPTS):
            try:
                fh = open(path, "rb")  # noqa: SIM115 - closed below, after its status
            except _NO_OBJECT:
                raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key) from None
            with fh:
                opened = os.fstat(fh.fileno())
                data = fh.read() if max_bytes is None else fh.read(max_bytes)
                etag = None
                if max_bytes is not None:
                    # The etag always names the whole object, as S3's does on a ranged GET.
                    rest = hashlib.md5(data, usedforsecurity=False)
                    for chunk in iter(functools.partial(fh.read, 1 << 20), b""):
                        rest.update(chunk)
                    etag = '"' + rest.hexdigest() + '"'
            if _unchanged(opened, path):
                return StoredObject(data, etag or etag_of(data))
        raise StorageUnavailable(f"object {key!r} kept changing while it was read")

    def _put(self, key: str, data: bytes, wait: bool = True) -> str:
        path = self._file(key)
        self._parent(path)
        tmp = self._write_tmp(data)
        placed, old = tmp, None
        try:
            with self._locked(key, wait=wait):
                old = _swap_in(tmp, path, key)
                tmp = ""
                crash_point(CrashPoint.STORE_AFTER_SWAP)
                ticket = self._logged(key, path, data)
        finally:
            if tmp:
                os.unlink(tmp)
            if old is not None:
                self._blanks.recycle(placed, old)
        self._log.sync(ticket)
        return etag_of(data)

    def _put_if_match(self, key: str, data: bytes, etag: str, wait: bool = True) -> str:
        new_etag, ticket = self._swap_if_match(key, data, etag, wait)
        self._log.sync(ticket)
        return new_etag

    def _swap_if_match(
        self, key: str, data: bytes, etag: str, wait: bool = True
    ) -> tuple[str, int]:
        """``_put_if_match`` up to its flush: the new object in place and logged; its
        etag, and the log's ticket that a flush must cover for it to be durable."""
        path = self._file(key)
        tmp = self._write_tmp(data)
        placed, old = tmp, None
        try:
            with self._locked(key, wait=wait):
                try:
                    current = etag_of(Path(path).read_bytes())
                except _NO_OBJECT:
                    raise EtagMismatch(f"object {key!r} no longer exists", key=key) from None
                if _normal(current) != _normal(etag):
                    raise EtagMismatch(f"object {key!r} changed since it was read", key=key)
                old = _swap_in(tmp, path, key)
                tmp = ""
                crash_point(CrashPoint.STORE_AFTER_SWAP)
                ticket = self._logged(key, path, data)
        finally:
            if tmp:
                os.unlink(tmp)
            if old is not None:
                self._blanks.recycle(placed, old)
        return etag_of(data), ticket

    def _list(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        # In key order, visiting only the folders the page needs (``storage.folder_pages``).
        return ListPage(*folder_pages.page_of(self._objects, prefix, start_after, limit))

    def _walk(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        def listed(prefix: str, after: str | None) -> list[str]:  # read as a page of ``list``
            return folder_pages.page_of(self._objects, prefix, after, sys.maxsize)[0]

        page, token = self._cursors.page(
            prefix, start_after, limit, listed=listed, present=self._present
        )
        return ListPage(page, token)

    def _present(self, key: str) -> bool:
        # Joined as listed, not checked as a key: a stray file whose name no key may
        # have (listed all the same by the first page) must not fail a later one.
        return os.path.isfile(f"{self._objects}/{key}")

    def _delete(self, key: str, wait: bool = True, *, etag: str | None = None) -> bool:
        """``key``'s object removed, the removal logged and flushed; whether there was
        one. With ``etag``, only if that is its etag still, compared under the key's
        lock as ``_swap_if_match`` compares: another write of the key waits for the
        lock and then finds no object, or went first and the etag differs (False:
        nothing removed, nothing logged). The removal itself is ``delete``'s, and so is
        its crash safety: the file moved out to ``.tmp``, then logged, then flushed."""
        path = self._file(key)
        gone, old = "", None
        try:
            with self._locked(key, wait=wait):
                if etag is not None:
                    try:
                        current = etag_of(Path(path).read_bytes())
                    except _NO_OBJECT:
                        return False  # gone, or objects' folder is there: no object
                    if _normal(current) != _normal(etag):
                        return False
                there = _occupant(path, key)
                if there is not None:
                    try:
                        gone = self._blanks.name()
                        os.rename(path, gone)  # kept to be recycled (``storage.blanks``)
                        old = there
                        crash_point(CrashPoint.STORE_AFTER_MOVE)
                    except OSError:  # ``.tmp`` removed by hand, say: removed as before
                        os.unlink(path)
                ticket = self._log.append(wal.Op.DELETE, key)
        finally:
            if old is not None:
                self._blanks.recycle(gone, old)
        self._log.sync(ticket)
        return there is not None

    def _move(self, key: str, to: str, wait: bool = True, *, after: int = 0) -> bool:
        """``key``'s file linked at ``to`` under both keys' locks, both changes logged, the
        log flushed once, and only then ``key``'s name removed: where a put and a delete
        were two files changed and two flushes in a row. Nothing orders the writes of two
        folders on disk (``storage.blanks``), so a rename could reach the disk as its
        removal alone; here the old name outlives every state the log does not cover. A
        power cut before the flush leaves the object at ``key`` (and perhaps at ``to``);
        after it, the replay puts it at ``to`` and removes ``key`` (unless a checkpoint
        began between the removal's record and the removal: then it may stay at both,
        which the move done again completes). ``after``: a ticket of this log the
        removal rests on (``MovesObjects.move``)."""
        if key == to:
            raise ValueError(f"a move needs two keys, not {key!r} twice")
        source, target = self._file(key), self._file(to)
        self._parent(target)
        with self._locks.held_both(key, to, wait=wait):
            # Nothing below an object, and no object at a folder (a folder there is
            # refused, as a delete refuses it: a link of it would fail with EPERM).
            there = _occupant(source, key)
            if there is None:
                return False
            size = there.st_size
            _occupant(target, to)  # a folder there is refused before anything moves
            try:
                os.link(source, target)
            except FileExistsError:
                # A move done again may find the object linked there already (a rename
                # onto another name of the same file changes nothing, and would leave
                # its name in ``.tmp`` behind); anything else is replaced in one step:
                # linked beside it, then renamed over it.
                if not os.path.samestat(os.stat(source), os.lstat(target)):
                    link = self._blanks.name()
                    os.link(source, link)
                    try:
                        os.replace(link, target)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            os.unlink(link)
                        raise
            crash_point(CrashPoint.STORE_AFTER_LINK)
            if size > wal.RECORD_MAX_BYTES:
                self._logged_in_place(to, target)
            else:
                self._log.append(wal.Op.PUT, to, Path(target).read_bytes())
            # Flushed with the locks held: the old name goes only once the log covers the
            # move, and no writer can put a new object at ``key`` meanwhile. The file is
            # not recycled (``storage.blanks``): it is the object, now at ``to``. The
            # removal is logged only if the record ``after`` names was not lost (another
            # writer's flush that covered it failed): then the move fails, the object
            # stays at ``key``, and no replay removes it there.
            self._log.sync(self._log.append(wal.Op.DELETE, key, after=after))
            crash_point(CrashPoint.STORE_MOVE_LOGGED)
            os.unlink(source)
        return True

    # -- async protocol -------------------------------------------------------------

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        if small_objects.holds(key):
            return await self._row(key, max_bytes)
        small = self._read_small(key)
        if small is not None:
            if max_bytes is not None:  # the etag names the whole object, as S3's does
                return StoredObject(small.data[:max_bytes], small.etag)
            return small
        return await self._off_loop(self._get, key, max_bytes)

    def _read_small(self, key: str) -> StoredObject | None:
        """A small object read on the caller's thread, None for a large one: a read of a
        few KiB from the page cache takes microseconds, a hop to a worker thread and
        back cost 0.19 ms of CPU (a snapshot header and an inbox event on every webhook)."""
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key) from None
        except OSError:
            return None  # the worker thread reports it, with the usual translation
        try:
            opened = os.fstat(fd)
            if opened.st_size > INLINE_READ_BYTES:
                return None
            data = os.read(fd, opened.st_size + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) != opened.st_size or not _unchanged(opened, path):
            return None  # changed while read: read again off the loop (``_get`` retries)
        return StoredObject(data, etag_of(data))

    async def put(self, key: str, data: bytes) -> str:
        if small_objects.holds(key):
            return (await self._row_replaced(key, data, expect=None)).etag
        return await self._write(functools.partial(self._put, key, data), size=len(data))

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        """Queued with the other creates waiting in this event loop: one worker thread
        writes them all and makes each durable, then links each into place. A small
        object that need not be ``durable`` is created at once on the caller's thread
        (``_create_now``)."""
        if small_objects.holds(key):
            etag, ticket = await self._row_created(key, data)
            if durable:
                await self._rows_durable(ticket)
            return etag
        if not durable and len(data) <= INLINE_READ_BYTES:
            return self._create_now(key, data)
        etag, _ = await self._queued(key, data, staged=False)
        return etag

    async def stage_if_absent(self, key: str, data: bytes) -> Staged:
        """``put_if_absent`` that may return once the object is in place and logged,
        before the log's flush: ``durable()`` waits for a flush that covers it, usually
        that of a create the caller made meanwhile (a flush covers everything logged
        before it). Queued like any create: alone, it is placed (on the caller's thread
        when ``_Inline`` allows, else in a worker thread) and not flushed; with other
        creates waiting beside it, it is made durable with them, one hop and one flush
        for all, as under load. A small object (``storage.small_objects``) is committed,
        the same way."""
        if small_objects.holds(key):  # flushed by the caller's next durable write, as here
            etag, ticket = await self._row_created(key, data)
            return Staged(etag, functools.partial(self._rows_durable, ticket))
        etag, ticket = await self._queued(key, data, staged=True)
        return Staged(etag, functools.partial(self._durable, ticket) if ticket else already_durable)

    async def _durable(self, ticket: int) -> None:
        """Return once the log's record ``ticket`` is flushed (at once if it is)."""
        if not self._log.synced(ticket):
            await self._write(lambda _wait: self._log.sync(ticket), size=0)

    async def _queued(self, key: str, data: bytes, *, staged: bool) -> tuple[str, int]:
        """A create made with the others asked for in this loop (``_create_batch``)."""
        return await self._creates.call((key, data, staged), self._create_batch)

    def _create_now(self, key: str, data: bytes) -> str:
        """Create-only without a record in the log: written to a temporary file and
        linked into place, so readers never see it half-written and one creator wins, as
        ever. It outlives any process (the page cache is the kernel's), not a power cut,
        which may take its name; its bytes are flushed before it is linked all the same
        (``_written``: no power cut leaves its name on bytes never written). Made on the
        caller's thread: queued behind a batch's flushes it cost the replay marker (a
        file then, a row now: ``storage.small_objects``) a whole flush of waiting."""
        try:
            path = self._file(key)
            self._parent(path)
            tmp = self._write_tmp(data)
            try:
                _place_new(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except FileExistsError:
            raise _taken(key, path) from None
        except OSError as exc:
            _raise_translated(exc)
        return etag_of(data)

    async def _create_batch(self, batch: _Creates) -> _Created:
        """Creates asked for together: each one's etag and the log's ticket still to be
        flushed for it (0: durable already), or its error."""
        items = [(key, data) for key, data, _ in batch]
        # A create staged alone is placed and logged, not flushed: its caller's next
        # create flushes both (``stage_if_absent``). Together, all are flushed.
        staged = len(batch) == 1 and batch[0][2]
        results: Sequence[str | tuple[str, int] | Exception]
        if len(items) == 1 and self._inline.allows(len(items[0][1])):
            # Alone a tick after it was asked for, with nothing else in flight: made here,
            # flush included (``_Inline``); creates that came together go to a worker
            # thread, one hop for all, while the loop serves on.
            if staged:
                results = _unflushed(
                    *self._inline.run(functools.partial(self._place_all, items, False))
                )
            else:
                results = self._inline.run(functools.partial(self._create_all, items, False))
            if isinstance(results[0], _Contended):  # locked elsewhere: wait off the loop
                results = await self._off_loop(self._create_all, items)
        elif staged:
            results = _unflushed(*await self._off_loop(self._place_all, items, True))
        else:
            results = await self._off_loop(self._create_all, items)
        return [
            (result, 0)
            if isinstance(result, str)
            else result
            if isinstance(result, tuple)
            else _translated(result)
            for result in results
        ]

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        if small_objects.holds(key):
            return (await self._row_replaced(key, data, expect=etag)).etag
        return await self._write(
            functools.partial(self._put_if_match, key, data, etag), size=len(data)
        )

    async def stage_if_match(self, key: str, data: bytes, *, etag: str) -> Staged:
        """``put_if_match`` that returns once the object is in place and logged, before
        the log's flush: ``durable()`` waits for a flush that covers it, usually that of
        a write the caller made meanwhile (a session's last commit: its marker's move)."""
        if small_objects.holds(key):
            return await self._row_replaced(key, data, expect=etag, staged=True)
        new_etag, ticket = await self._write(
            functools.partial(self._swap_if_match, key, data, etag), size=len(data)
        )
        return _Logged(
            new_etag, functools.partial(self._durable, ticket), self._log, ticket, os.getpid()
        )

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        files, rows = small_objects.reach(prefix)
        if not rows:
            return await self._list_files(prefix, start_after, limit)
        keys = await self._row_keys(prefix, start_after, limit)
        if not files:
            return _page(keys, prefix, start_after, limit)
        return _merged(await self._list_files(prefix, start_after, limit), keys, limit)

    async def _list_files(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        small = self._list_small(prefix, start_after, limit)
        if small is not None:
            return small
        return await self._off_loop(self._list, prefix, start_after, limit)

    def _list_small(self, prefix: str, start_after: str | None, limit: int) -> ListPage | None:
        """A listing of one small folder of files (a session's inbox, three times per
        activation) on the caller's thread: a few microseconds against 0.5 ms for the
        hop to a worker thread and back. None for anything larger or deeper."""
        folder, _, _ = prefix.rpartition("/")
        if not folder or not folder_pages.spelled_as_keys(folder):
            return None  # the root, or a prefix spelled unlike the keys ("a//b/", "../")
        top = self.root / "objects" / folder
        keys: list[str] = []
        try:
            with os.scandir(top) as entries:
                for n, entry in enumerate(entries):
                    if n >= INLINE_LIST_ENTRIES or not entry.is_file(follow_symlinks=False):
                        return None  # large, or not flat: walked off the loop
                    keys.append(f"{folder}/{entry.name}")
        except FileNotFoundError:
            return ListPage([], None)
        except OSError:
            return None  # the worker thread reports it, with the usual translation
        return _page(keys, prefix, start_after, limit)

    async def walk(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        """``list`` for a walk of the whole prefix: a large folder is listed once for the
        walk, not once per page (``storage.cursors``)."""
        files, rows = small_objects.reach(prefix)
        if not rows:
            return await self._off_loop(self._walk, prefix, start_after, limit)
        keys = await self._row_keys(prefix, start_after, limit)
        if not files:
            return _page(keys, prefix, start_after, limit)
        walked = await self._off_loop(self._walk, prefix, start_after, limit)
        return _merged(walked, keys, limit)

    async def delete(self, key: str) -> None:
        if small_objects.holds(key):
            check_object_key(key)
            ticket = await self._rows_now(lambda wait: self._rows.remove(key, wait=wait))
            await self._rows_durable(ticket)
            return
        await self._write(functools.partial(self._delete, key), size=0)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        if small_objects.holds(key):
            check_object_key(key)
            ticket = await self._rows_now(
                lambda wait: self._rows.remove_if_match(key, etag, wait=wait)
            )
            if ticket is None:
                return False
            await self._rows_durable(ticket)
            return True
        return await self._write(functools.partial(self._delete, key, etag=etag), size=0)

    async def move(self, key: str, to: str, *, after: Staged | None = None) -> bool:
        if small_objects.holds(key) or small_objects.holds(to):
            return await self._row_moved(key, to, after)
        ticket = 0
        if isinstance(after, _Logged) and after.log is self._log and after.pid == os.getpid():
            ticket = after.ticket  # ordered in the log: ``_move``
        elif after is not None:  # another store's write: durable before anything moves
            await after.durable()
        try:  # a large object is moved off the loop, as it is written
            size = os.stat(self._file(key)).st_size
        except OSError:
            size = 0  # missing: ``_move`` says so under the locks
        return await self._write(functools.partial(self._move, key, to, after=ticket), size=size)

    # -- small objects, as rows (``storage.small_objects``) ------------------------------

    async def _rows_now(self, call: Callable[[bool], T]) -> T:
        """``call(wait)`` on the caller's thread (a few microseconds) unless another
        process holds the table's write lock: then in a worker thread, which waits."""
        try:
            return call(False)
        except small_objects.Busy:
            return await self._off_loop(call, True)

    async def _row(self, key: str, max_bytes: int | None) -> StoredObject:
        check_object_key(key)
        found = await self._rows_now(lambda wait: self._rows.get(key, wait=wait))
        if found is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key)
        data, etag = found
        return StoredObject(data if max_bytes is None else data[:max_bytes], etag)

    async def _row_keys(self, prefix: str, start_after: str | None, limit: int) -> _Keys:
        """One more than ``limit`` if there are more: ``_page`` and ``_merged`` tell so."""
        if not prefix.isascii():
            return []  # keys are ASCII (``keys.check_object_key``): none starts with it
        return await self._rows_now(
            lambda wait: self._rows.keys(prefix, start_after, limit + 1, wait=wait)
        )

    async def _row_created(self, key: str, data: bytes) -> tuple[str, int]:
        """A create made with the others asked for in this event loop (one transaction
        for all, ``_create_row_batch``): its etag and its commit's ticket."""
        check_object_key(key)
        etag = etag_of(data)
        return etag, await self._row_creates.call((key, data, etag), self._create_row_batch)

    async def _create_row_batch(self, items: _RowCreates) -> _RowsCreated:
        """Rows created in one transaction: its ticket for each row made, ``ObjectExists``
        for each whose key was taken. Should the transaction fail, every create fails."""
        create = functools.partial(_create_rows_in, self._rows, items)
        # A large block (an audit block under load) is copied off the loop.
        if sum(len(data) for _, data, _ in items) <= INLINE_READ_BYTES:
            made, ticket = await self._rows_now(create)
        else:
            made, ticket = await self._off_loop(create, True)
        return [
            ticket if won else ObjectExists(f"object {key!r} already exists", key=key)
            for (key, _, _), won in zip(items, made, strict=True)
        ]

    async def _row_replaced(
        self, key: str, data: bytes, *, expect: str | None, staged: bool = False
    ) -> Staged:
        check_object_key(key)
        etag = etag_of(data)

        def replace(wait: bool) -> int:
            return self._rows.replace(key, data, etag, expect=expect, wait=wait)

        # A large object (a long session's snapshot) is copied off the loop.
        if len(data) <= INLINE_READ_BYTES:
            ticket = await self._rows_now(replace)
        else:
            ticket = await self._off_loop(replace, True)
        if not staged:
            await self._rows_durable(ticket)
        return Staged(etag, functools.partial(self._rows_durable, ticket))

    async def _row_moved(self, key: str, to: str, after: Staged | None) -> bool:
        """``move`` where either key is a row's: one transaction if both are (durable
        on return), else a put of ``to`` and then a delete of ``key`` (a crash between
        leaves it at both; the move done again completes it)."""
        if key == to:
            raise ValueError(f"a move needs two keys, not {key!r} twice")
        check_object_key(key)
        check_object_key(to)
        if after is not None:
            await after.durable()
        if small_objects.holds(key) and small_objects.holds(to):
            ticket = await self._rows_now(lambda wait: self._rows.rename(key, to, wait=wait))
            if ticket is None:
                return False
            await self._rows_durable(ticket)
            return True
        try:
            found = await self.get(key)
        except ObjectNotFound:
            return False
        await self.put(to, found.data)
        await self.delete(key)
        return True

    async def _rows_durable(self, ticket: int) -> None:
        """Return once the rows' commit ``ticket`` is durable: flushes of one event loop
        go one at a time, each for everything committed before it; alone, with nothing
        else in flight and the disk quick (``_Inline``), on the caller's thread."""
        while self._rows.synced < ticket:
            loop = asyncio.get_running_loop()
            flush = self._row_syncs.get(loop)
            if flush is None or flush.done():
                if self._inline.allows(0):
                    try:
                        self._inline.run(functools.partial(self._rows.sync, ticket))
                    except OSError as exc:
                        _raise_translated(exc)
                    continue
                flush = asyncio.ensure_future(self._off_loop(self._rows.sync, self._rows.committed))
                self._row_syncs[loop] = flush
                # Not kept once done: a future holds its loop, which the weak key would
                # not free (a store outlives the loops that used it).
                flush.add_done_callback(functools.partial(forget_when_done, self._row_syncs))
            await asyncio.shield(flush)
        if self._rows.checkpoint_due():
            _threads().submit(_checkpoint, self._rows)

    async def _write(self, write: Callable[[bool], T], *, size: int) -> T:
        """A locked write, ``write(wait)``: on the caller's thread when ``_Inline`` allows
        it and the key's lock is free, else in a worker thread, waiting for the lock."""
        if self._inline.allows(size):
            try:
                return self._inline.run(functools.partial(write, False))
            except _Contended:
                pass  # another process holds the key: wait for it off the loop
            except OSError as exc:
                _raise_translated(exc)
        return await self._off_loop(write, True)

    async def warm(self) -> None:
        """The lock files opened, the log's first segment put in place and the empty
        files and folders made ahead, now. A new process did all of it inside its first
        write, on metadata the kernel had not read yet (inode tables, block bitmaps):
        the first webhook a replica took answered in 12-20 ms, its blank makers and its
        handler queued on one folder's lock."""
        await self._off_loop(self._warm)

    def _warm(self) -> None:
        if not self._finalizer.alive:
            return  # closed: nothing it opened now would be closed again
        self._locks.open_all()
        self._log.ready()
        self._blanks.fill()
        self._blank_folders.fill()

    async def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer()
        else:  # used again since it was closed: what that reopened is given back too
            _release(self._locks, self._log, self._blanks, self._blank_folders, rows=self._rows)

    async def _off_loop(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        self._inline.in_flight += 1
        try:
            return await loop.run_in_executor(_threads(), lambda: fn(*args, **kwargs))
        except OSError as exc:
            _raise_translated(exc)
        finally:
            self._inline.in_flight -= 1


@dataclass(frozen=True, slots=True)
class _Logged(Staged):
    """A staged write of one store: the log, and its ticket, a flush must cover; in the
    process that made it (a forked child's log numbers its tickets anew)."""

    log: wal.WriteAheadLog
    ticket: int
    pid: int


def _unflushed(
    results: list[str | Exception], ticket: int
) -> list[str | tuple[str, int] | Exception]:
    """``_place_all``'s results, each etag paired with the ticket still to be flushed."""
    return [(r, ticket) if isinstance(r, str) else r for r in results]


def _release(
    locks: _Stripes,
    log: wal.WriteAheadLog,
    *made: blanks.Blanks,
    rows: small_objects.SmallObjects,
) -> None:
    if wal.own_thread():
        # The store was collected on one of its log's own threads, which may hold the
        # log's lock (a collection set off by an allocation under it): released there,
        # it would wait for itself. Another thread waits for the lock instead.
        threading.Thread(
            target=_release,
            args=(locks, log, *made),
            kwargs={"rows": rows},
            name="torpor-store-release",
            daemon=True,
        ).start()
        return
    locks.close()
    log.release()
    rows.close()
    for made_ahead in made:
        made_ahead.close()


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_SYNC_WRITE = 2  # sync_file_range's SYNC_FILE_RANGE_WRITE: start the writeback, return
_RENAME_EXCHANGE = 2
_libc: list[ctypes.CDLL | None] = []
_no_exchange: list[bool] = []  # set once the file system has refused to swap


def _in_the_way(key: str) -> InvalidKey:
    """A key the local folder cannot hold beside another: below an object (``a/b`` when
    ``a`` is one) or where objects' folder is (``q`` when ``q/w`` is). An object store
    holds both; torpor's own keys never meet this, so it is the caller's key that is
    refused, with a typed error rather than the file system's."""
    return InvalidKey(
        f"{key!r}: the local folder holds no object below another, nor at another's folder"
    )


def _taken(key: str, path: str) -> ObjectExists | InvalidKey:
    """Why a create found its name taken: the object exists, or objects' folder is there."""
    if os.path.isdir(path):
        return _in_the_way(key)
    return ObjectExists(f"object {key!r} already exists", key=key)


def _occupant(path: str, key: str) -> os.stat_result | None:
    """The status of what is at ``path`` (not followed if a link), None if nothing. A
    folder is refused before anything moves, as ``os.replace`` and ``unlink`` refuse it."""
    try:
        there = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # a file where a folder would be
        return None
    if stat.S_ISDIR(there.st_mode):
        raise _in_the_way(key)
    return there


def _swap_in(tmp: str, path: str, key: str) -> os.stat_result | None:
    """Put the file ``tmp`` at ``path``, atomically, as ``os.replace`` does. The status
    of the file that was at ``path`` if it is now at ``tmp`` (one
    ``renameat2(RENAME_EXCHANGE)``): its inode is kept to be recycled, not freed
    (``storage.blanks``). None if there was none, or the kernel or the file system
    cannot swap (then ``os.replace``)."""
    there = _occupant(path, key)
    libc = _kernel()
    if there is not None and libc is not None and not _no_exchange:
        swap = _AT_FDCWD, tmp.encode(), _AT_FDCWD, path.encode(), _RENAME_EXCHANGE
        if libc.renameat2(*swap) == 0:
            return there
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            _no_exchange.append(True)
        elif err != errno.ENOENT:  # ENOENT: removed since the lstat
            raise OSError(err, os.strerror(err), path)
    os.replace(tmp, path)
    return None


def _unchanged(opened: os.stat_result, path: str) -> bool:
    """Whether what was read through a descriptor whose status was ``opened`` right
    after its open is ``path``'s content: after the read, ``path`` still names that file
    with the same ``ctime`` and size. An object's file never changes while it is at its
    key (writes go to new files), so the read saw the key's content. A file recycled
    meanwhile (``storage.blanks``) left its key and was truncated at least
    ``QUARANTINE_S`` later; if it came back to the key since, its ``ctime`` moved on by
    as much. Compares the file with itself, not with the wall clock: a clock stepped
    back leaves fresh objects readable."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False  # removed meanwhile: the next attempt says so
    return (
        now.st_ino == opened.st_ino
        and now.st_dev == opened.st_dev
        and now.st_ctime_ns == opened.st_ctime_ns
        and now.st_size == opened.st_size
    )


def _place_new(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` unless ``path`` exists (``FileExistsError``): one atomic
    ``renameat2(RENAME_NOREPLACE)``, where ``link`` then ``unlink`` changed the folders
    twice (metadata operations are what a create costs here). Falls back to those two
    where the kernel or the file system lacks it."""
    libc = _kernel()
    if libc is not None:
        if (
            libc.renameat2(_AT_FDCWD, tmp.encode(), _AT_FDCWD, path.encode(), _RENAME_NOREPLACE)
            == 0
        ):
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), path)
        _libc[0] = None
    os.link(tmp, path)  # atomic create-only: EEXIST if anyone got there first
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def _place_folder(blank: str, path: str) -> bool:
    """Rename the empty folder ``blank`` to ``path`` unless ``path`` exists; False if it
    does, or its parent does not, or the kernel cannot."""
    libc = _kernel()
    renamed = _AT_FDCWD, blank.encode(), _AT_FDCWD, path.encode(), _RENAME_NOREPLACE
    return libc is not None and libc.renameat2(*renamed) == 0


def _start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty bytes to the disk, without waiting for them (a hint:
    the flush that follows is what makes them durable, and reports what fails)."""
    libc = _kernel()
    if libc is not None and getattr(libc, "sync_file_range", None) is not None:
        libc.sync_file_range(fd, ctypes.c_longlong(0), ctypes.c_longlong(0), _SYNC_WRITE)


def _kernel() -> ctypes.CDLL | None:
    """The C library, if it has ``renameat2`` (None where it or the file system lacks it)."""
    if not _libc:
        found = ctypes.CDLL(None, use_errno=True)
        _libc.append(found if getattr(found, "renameat2", None) is not None else None)
    return _libc[0]


def _page(keys: list[str], prefix: str, start_after: str | None, limit: int) -> ListPage:
    """The keys under ``prefix`` after ``start_after``, sorted, at most ``limit``."""
    found = sorted(
        k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after)
    )
    page = found[:limit]
    return ListPage(page, page[-1] if len(found) > limit else None)


def _merged(files: ListPage, rows: list[str], limit: int) -> ListPage:
    """A page of files and the rows after the same position (one more than ``limit`` if
    there are more), as one page: each source holds every key of its own up to its last,
    so the first ``limit`` keys of both are the first ``limit`` of the two together."""
    both = sorted({*files.keys, *rows})
    page = both[:limit]
    more = files.next_token is not None or len(rows) > limit or len(both) > limit
    return ListPage(page, page[-1] if more and page else None)


def _checkpoint(rows: small_objects.SmallObjects) -> None:
    try:
        rows.checkpoint()
    except (OSError, StorageUnavailable) as exc:  # the next one tries again; nothing lost
        log.warning("local object store: a checkpoint of the rows' log failed: %s", exc)


def _create_rows_in(
    rows: small_objects.SmallObjects, items: list[tuple[str, bytes, str]], wait: bool
) -> tuple[list[bool], int]:
    return rows.create(items, wait=wait)


def _translated(exc: Exception) -> Exception:
    """A full, read-only or failing disk is the store being unavailable (503), not a bug."""
    if isinstance(exc, OSError) and exc.errno in (
        errno.ENOSPC,
        errno.EROFS,
        errno.EACCES,
        errno.EIO,
    ):
        return StorageUnavailable(f"local object store I/O failed: {exc.strerror}")
    return exc


def _raise_translated(exc: OSError) -> NoReturn:
    """Raise ``exc`` as the store's typed error if it names one, else as it is."""
    translated = _translated(exc)
    if translated is exc:
        raise exc
    raise translated from exc
