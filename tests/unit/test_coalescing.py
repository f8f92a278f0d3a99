"""Background activation requests: coalesced per session, bounded, never raising."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from storage.memory_index import MemoryIndex
from torpor.clock import ManualClock
from torpor.ports import Observer, Reason, TimerKind
from torpor.service.coalescing import Coalescer, Fallback, request_activation

RETRY_DELAY = timedelta(seconds=5)


class Deferrals(Observer):
    def __init__(self) -> None:
        self.reasons: list[str] = []

    async def activation_deferred(self, reason: str) -> None:
        self.reasons.append(reason)


def coalescer_for(
    activator: HeldActivator, max_inflight: int, index: MemoryIndex | None = None
) -> Coalescer:
    fallback = Fallback(index or MemoryIndex(), ManualClock(), Deferrals(), RETRY_DELAY)
    return Coalescer(activator, max_inflight=max_inflight, fallback=fallback)


class HeldActivator:
    """Records requests; each one is held until the test releases it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Reason]] = []
        self.release = asyncio.Event()
        self.fail = False

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        self.requests.append((session_id, reason))
        await self.release.wait()
        if self.fail:
            raise ConnectionError("actor gone")


async def started(activator: HeldActivator, n: int) -> None:
    async with asyncio.timeout(5):
        while len(activator.requests) < n:
            await asyncio.sleep(0)


async def test_a_burst_for_one_session_costs_one_more_request_at_most() -> None:
    activator = HeldActivator()
    coalescer = coalescer_for(activator, 10)
    coalescer.request("s1", Reason.SUBMIT, "a")
    await started(activator, 1)
    for _ in range(5):  # duplicates arriving while the first request runs
        coalescer.request("s1", Reason.EVENT, "a")
    activator.release.set()
    await coalescer.drain()
    assert activator.requests == [("s1", Reason.SUBMIT), ("s1", Reason.EVENT)]


async def test_past_the_bound_requests_are_left_to_the_reconciler() -> None:
    activator = HeldActivator()
    coalescer = coalescer_for(activator, 2)
    for sid in ("s1", "s2", "s3"):
        coalescer.request(sid, Reason.EVENT, None)
    await started(activator, 2)
    activator.release.set()
    await coalescer.drain()
    assert [sid for sid, _ in activator.requests] == ["s1", "s2"]
    coalescer.request("s3", Reason.EVENT, None)  # room again once they finished
    await coalescer.drain()
    assert activator.requests[-1] == ("s3", Reason.EVENT)


async def test_a_failed_request_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    activator = HeldActivator()
    activator.fail = True
    activator.release.set()
    with caplog.at_level(logging.WARNING):
        await request_activation(activator, "s1", Reason.EVENT, None)
        coalescer = coalescer_for(activator, 1)
        coalescer.request("s2", Reason.EVENT, None)
        await coalescer.drain()
    assert [r.getMessage() for r in caplog.records] == [
        "activation request for s1 failed; the reconciler will retry",
        "activation request for s2 failed; the reconciler will retry",
    ]
    coalescer.request("s2", Reason.EVENT, None)  # a failure frees the session's slot
    await coalescer.drain()
    assert len(activator.requests) == 3


async def test_past_the_bound_a_retry_timer_is_made_sure_of_and_counted() -> None:
    activator, index = HeldActivator(), MemoryIndex()
    coalescer = coalescer_for(activator, 1, index)
    clock = coalescer.fallback.clock
    assert isinstance(clock, ManualClock)
    soon = clock.now() + timedelta(seconds=1)
    await index.schedule(kind=TimerKind.RETRY, member="s3", at=soon)  # already due sooner
    for sid in ("s1", "s2", "s3"):
        coalescer.request(sid, Reason.EVENT, None)
    await started(activator, 1)
    activator.release.set()
    await coalescer.drain()
    due = await index.due(kind=TimerKind.RETRY, now=clock.now() + RETRY_DELAY, limit=10)
    assert due == ["s3", "s2"], "each request left out has a retry timer, none delayed"
    assert await index.due(kind=TimerKind.RETRY, now=soon, limit=10) == ["s3"]
    observer = coalescer.fallback.observer
    assert isinstance(observer, Deferrals) and observer.reasons == ["backpressure"] * 2


async def test_a_failed_request_leaves_a_retry_timer() -> None:
    activator, index = HeldActivator(), MemoryIndex()
    activator.fail = True
    activator.release.set()
    coalescer = coalescer_for(activator, 4, index)
    coalescer.request("s1", Reason.SUBMIT, None)
    await coalescer.drain()
    now = coalescer.fallback.clock.now()
    assert await index.due(kind=TimerKind.RETRY, now=now + RETRY_DELAY, limit=10) == ["s1"]
