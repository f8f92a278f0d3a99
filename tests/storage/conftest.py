"""Fixtures of the storage tests."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from storage import wal
from storage.local_store import LocalObjectStore
from torpor.faults import ENV, CrashPoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def boot(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The boot the next store opens in: ``boot[0] = ...`` is a reboot."""
    current = ["boot-a"]
    monkeypatch.setattr(wal, "boot_id", lambda: current[0])
    return current


class FailingOnce:
    """``flush`` (a flush of a descriptor) that fails the first time, as a failing
    writeback reports (EIO), and flushes every time after; ``failed`` once it has."""

    def __init__(self, flush: Callable[[int], None]) -> None:
        self._flush = flush
        self.failed = False

    def __call__(self, fd: int) -> None:
        if not self.failed:
            self.failed = True
            raise OSError(errno.EIO, "Input/output error")
        self._flush(fd)


def killed_child(script: str, *args: str, at: CrashPoint) -> bytes:
    """Run ``script`` (Python, from the repo's root) in a child told to die at ``at``; it
    must have died there, by SIGKILL, before printing ``survived``. Its output."""
    child = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT), ENV: at.value},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert b"survived" not in child.stdout
    return child.stdout


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A redis-py client of the test Redis (text replies), closed after the test."""
    made = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield made
    await made.aclose()


def refills_done(store: LocalObjectStore, timeout_s: float = 10.0) -> None:
    """Wait (``timeout_s`` at most) for the refills of a local store's made-ahead files
    and folders that its writes started: one under way could take, or make, a file the
    test is looking at. Synchronous: it is also called from inside a running loop (a
    reader the test stalls)."""
    made = (store._blanks, store._blank_folders)
    deadline = time.monotonic() + timeout_s
    while any(m._making for m in made):
        if time.monotonic() > deadline:
            raise AssertionError(f"the store's refills did not end within {timeout_s}s")
        time.sleep(0.001)


def until(condition: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    """Wait (``timeout_s`` at most) for ``condition()``: what a store's worker thread
    does after the call that asked for it returned (a hand-over to ``spare``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.001)
