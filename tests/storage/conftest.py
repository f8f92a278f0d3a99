"""Fixtures of the storage tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from storage.local_store import LocalObjectStore


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
