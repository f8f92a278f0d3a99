"""The local object store's per-key locks (``storage.local_store``): striped lock files
shared by the host's processes, a thread lock beside each."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import threading
import weakref
import zlib
from collections.abc import Iterator

LOCK_STRIPES = 64


class _Contended(Exception):
    """A key's lock is held elsewhere: the write is not made on the caller's thread."""


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
