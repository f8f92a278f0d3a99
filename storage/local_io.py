"""Where the local object store's blocking I/O runs (``storage.local_store``): the
worker threads every store of the process shares, or the caller's thread when ``_Inline``
allows it; and what an OS error of the disk is to the store's callers."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn, TypeVar

from torpor.errors import StorageUnavailable

T = TypeVar("T")

# One pool per process, shared by every store in it (threads are started as needed).
WRITER_THREADS = 32
INLINE_READ_BYTES = 64 * 1024
# A write is made on the caller's thread only while flushes take less than this (a
# moving average): above it, the event loop would stall for the disk.
INLINE_FLUSH_BUDGET_S = 0.002
# ... and while writes made there have taken at most this share of the loop's time (a
# burst of INLINE_BURST_S aside): under load the loop has other work to do meanwhile,
# and the worker threads flush while it does it.
INLINE_SHARE = 0.25
INLINE_BURST_S = 0.005
_THREADS: dict[int, ThreadPoolExecutor] = {}


def _threads() -> ThreadPoolExecutor:
    # Keyed by process: a forked child must not inherit a pool whose threads it lacks.
    pid = os.getpid()
    if pid not in _THREADS:
        _THREADS.clear()
        _THREADS[pid] = ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="torpor-files")
    return _THREADS[pid]


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
