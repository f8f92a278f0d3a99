"""Group commit for files: one ``syncfs`` for every writer waiting at the same moment.

A writer first writes its bytes (not yet durable), then calls :meth:`GroupSync.wait`. If no
sync is running, it runs one (the *leader*); a sync that starts after a writer's bytes were
written makes them durable, so every writer that arrived before the leader started is
released by it, and the writers arriving meanwhile are covered by the next one. Under load
a flush is shared by as many writers as are waiting; a writer alone ``fsync``s its own
file, as it always did.

``syncfs(2)`` (Linux) flushes the whole file system the folder is on: a folder beside
heavy unrelated writes makes each flush slower. Where ``syncfs`` does not exist,
each writer ``fsync``s its own file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable


def _syncfs() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name, use_errno=True), "syncfs", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNCFS = _syncfs()
_SHARED: dict[tuple[int, int], GroupSync] = {}
_SHARED_LOCK = threading.Lock()


class GroupSync:
    """Group commit on one file system (``of`` shares one per file system and process)."""

    @classmethod
    def of(cls, folder: str) -> GroupSync:
        # Keyed by process too: a forked child must not share its parent's lock state.
        key = (os.getpid(), os.stat(folder).st_dev)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls(folder)
            return _SHARED[key]

    def __init__(
        self,
        folder: str,
        *,
        syncfs: Callable[[int], int] | None = _SYNCFS,
        fsync: Callable[[int], None] = os.fsync,
    ) -> None:
        self._syncfs = syncfs
        self._fsync = fsync
        self._fd = os.open(folder, os.O_RDONLY) if syncfs is not None else -1
        self._cond = threading.Condition()
        self._arrived = 0  # writers that have asked, in order
        self._durable = 0  # every writer up to this one is durable
        self._running = False
        self.flushes = 0  # for the tests and the benchmarks

    def wait(self, *fds: int) -> None:
        """Return once everything this thread wrote before calling is on disk (``fds``:
        the files it wrote, still open)."""
        if self._syncfs is None:
            for fd in fds:
                self._fsync(fd)
            return
        with self._cond:
            self._arrived += 1
            ticket = self._arrived
            while self._durable < ticket:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                covered = self._arrived  # every writer so far wrote before this sync
                alone = covered - self._durable == 1 and len(fds) == 1
                self._cond.release()
                try:
                    # Alone, a writer's own fsync is cheaper than flushing the whole file
                    # system (which may hold others' dirty data: 10 ms against 7 ms per
                    # sequential webhook here).
                    self._fsync(fds[0]) if alone else self._flush()
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
                self._durable = max(self._durable, covered)

    def _flush(self) -> None:
        assert self._syncfs is not None
        if self._syncfs(self._fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.flushes += 1
