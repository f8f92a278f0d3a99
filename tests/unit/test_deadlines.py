"""``call_out``: deadlines on async and plain calls; a plain def runs off the loop and a
call still running under a key is joined, never started twice."""

from __future__ import annotations

import asyncio
import threading

import pytest

from torpor.deadlines import call_out, running
from torpor.errors import CallTimedOut, RetryableError


async def test_an_async_call_past_its_deadline_is_a_typed_retryable_error() -> None:
    async def hang() -> None:
        await asyncio.Event().wait()

    with pytest.raises(CallTimedOut, match=r"hang did not finish within 0\.01 s") as info:
        await call_out(hang, timeout_s=0.01, what="hang")
    assert isinstance(info.value, RetryableError) and info.value.code == "call_timed_out"


async def test_a_plain_def_runs_in_a_thread_while_the_loop_goes_on() -> None:
    release = threading.Event()
    ticks = 0

    def blocking() -> str:
        assert release.wait(timeout=5.0), "the loop never got to release it"
        return "done"

    async def tick() -> None:
        nonlocal ticks
        while ticks < 3:
            ticks += 1
            await asyncio.sleep(0)
        release.set()

    ticker = asyncio.create_task(tick())
    assert await call_out(blocking, timeout_s=5.0, what="blocking") == "done"
    await ticker
    assert ticks == 3


async def test_a_timed_out_thread_is_joined_by_a_retry_under_the_same_key() -> None:
    release = threading.Event()
    calls = 0

    def slow() -> int:
        nonlocal calls
        calls += 1
        release.wait(timeout=5.0)
        return calls

    with pytest.raises(CallTimedOut):
        await call_out(slow, timeout_s=0.02, what="slow", key="k1")
    assert running("k1")
    with pytest.raises(CallTimedOut):
        await call_out(slow, timeout_s=0.02, what="slow", key="k1")  # joined, not started
    release.set()
    assert await call_out(slow, timeout_s=5.0, what="slow", key="k1") == 1
    assert calls == 1
    assert not running("k1")
