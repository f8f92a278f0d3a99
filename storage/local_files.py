"""One object held as a file in the local object store (``storage.local_store``): read
and checked against its key after the read, replaced (with or without an etag to match),
removed, or moved to another key, each change under its key's lock, logged and flushed."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os

from storage import wal
from storage.local_folder import LocalFolder
from storage.local_fs import (
    _NO_OBJECT,
    _normal,
    _occupant,
    _swap_in,
    _unchanged,
    etag_of,
)
from storage.local_io import INLINE_READ_BYTES
from torpor.errors import EtagMismatch, ObjectNotFound, StorageUnavailable
from torpor.faults import CrashPoint, crash_point
from torpor.ports import StoredObject

# A read that finds its key changed under it (``_unchanged``) reads the key again, at most
# this many times in all: each retry needs another write to land inside the read.
READ_ATTEMPTS = 5


class LocalFiles(LocalFolder):
    """The blocking reads and changes of one object's file."""

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
                    current = etag_of(_contents(path))
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
                        current = etag_of(_contents(path))
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
                self._log.append(wal.Op.PUT, to, _contents(target))
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


def _contents(path: str) -> bytes:
    """The file's bytes, as ``Path.read_bytes`` reads them, in four system calls: open,
    fstat, read, close. ``open()`` makes nine (its buffer asks whether the file is a
    terminal and where it stands, and reads on to an empty read), three times a
    session's resume. The one read is asked for a byte more than the file holds: all of
    it and no more is its end. Anything else reads on to an empty read, as ``open()``
    does: a file grown since (more), one cut short, or a read the kernel capped (fewer:
    Linux returns at most 2 GiB less a page a call). A directory, as with ``open()``,
    is ``IsADirectoryError`` (from the read here)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) == size:
            return data
        parts = [data]
        while chunk := os.read(fd, 1 << 16):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)
