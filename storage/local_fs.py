"""The local object store's steps on the file system (``storage.local_store``): a file
moved into place create-only or swapped in atomically (``renameat2``, with the fallbacks
where the kernel or the file system lacks it), what stands at a key's path, the check a
reader makes after its read, the writeback hint, and an object's etag."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import stat

from torpor.errors import InvalidKey, ObjectExists

# What opening a key's path raises when no object is there: nothing at it, a file where
# one of its folders would be ("a/b" when "a" is an object), or a folder at it ("q" when
# "q/w" is). No key names a folder, so the last is missing too, to a read.
_NO_OBJECT = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def etag_of(data: bytes) -> str:
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


def _normal(etag: str) -> str:
    return etag.strip('"')


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
