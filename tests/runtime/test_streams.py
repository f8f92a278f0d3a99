"""Event streams: capped per tenant, and an idle one does not re-read the object store."""

from __future__ import annotations

import pytest

from storage import keys
from tests.runtime.memory_env import MemEnv, memory_env, plan_agent, reset
from torpor.lifecycle import SessionState
from torpor.ports import ObjectStore, StoredObject
from torpor.service.streams import SAFETY_READ_S, TICK_S, SessionStreams, TooManyStreams

PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
AGENTS = {"a": plan_agent(PLAN, {"tests.runtime.memory_env:Approve": {}})}


class Ticks:
    """A sleep that lets no wall time pass; it runs ``at[n]`` on the n-th tick."""

    def __init__(self, at: dict[int, object] | None = None) -> None:
        self.count, self.at = 0, at or {}

    async def __call__(self, seconds: float) -> None:
        self.count += 1
        action = self.at.get(self.count)
        if action is not None:
            await action()  # type: ignore[operator]


def count_snapshot_reads(env: MemEnv, sid: str) -> list[int]:
    reads = [0]
    store: ObjectStore = env.services.store
    original = store.get

    async def get(key: str, *, max_bytes: int | None = None) -> StoredObject:
        if key == keys.snapshot(sid):
            reads[0] += 1
        return await original(key, max_bytes=max_bytes)

    store.get = get  # type: ignore[method-assign]
    return reads


async def test_an_idle_stream_reads_the_snapshot_only_on_a_change_or_a_slow_safety_tick() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        assert (await env.load(sid)).state is SessionState.SUSPENDED
        reads = count_snapshot_reads(env, sid)

        idle: list[int] = []

        async def cancel() -> None:
            idle.append(reads[0])  # what 100 s of idle streaming cost
            await env.control.cancel(sid, tenant="acme")

        ticks = Ticks({200: cancel})  # 100 s of idle stream, then a change
        streams = SessionStreams(env.control, max_per_tenant=4, sleep=ticks)
        events = [e async for e in streams.open(sid, "acme", 0)]
        idle_reads = 1 + int(200 * TICK_S / SAFETY_READ_S)  # the first, then the safety reads
        assert idle[0] <= idle_reads, f"{idle[0]} snapshot reads in 200 ticks"
        assert ticks.count == 200, "the change was seen at the end of the tick it came in"
        states = [e for e in events if "event: transition" in e]
        assert '"state": "CANCELLED"' in states[-1]
        assert streams.streams("acme") == 0  # the ended stream gave its slot back


async def test_streams_are_capped_per_tenant_with_a_retry_after() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        streams = SessionStreams(env.control, max_per_tenant=2, sleep=Ticks())
        first, second = streams.open(sid, "acme", 0), streams.open(sid, "acme", 0)
        with pytest.raises(TooManyStreams) as refused:
            streams.open(sid, "acme", 0)
        assert refused.value.status == 429 and refused.value.retry_after
        other = streams.open(sid, "beta", 0)  # another tenant has its own share
        await first.__anext__()
        await first.aclose()  # a client that went away gives its slot back
        await second.aclose()  # even one that never read
        await other.aclose()
        assert streams.streams("acme") == 0
        streams.open(sid, "acme", 0)


async def test_a_waiting_sessions_work_progress_is_streamed_without_waking_it() -> None:
    from datetime import UTC, datetime

    from torpor.work import Progress

    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        generation = (await env.load(sid)).generation
        progress = env.services.progress
        assert progress is not None

        async def report() -> None:
            at = datetime.now(UTC)
            await progress.report(
                sid,
                Progress(work_id="w1", tool_name="ocr", fraction=0.4, message="page 12/30", at=at),
            )

        async def cancel() -> None:
            await env.control.cancel(sid, tenant="acme")

        ticks = Ticks({3: report, 12: cancel})
        streams = SessionStreams(env.control, max_per_tenant=4, sleep=ticks)
        events = [e async for e in streams.open(sid, "acme", 0)]
        shown = [e for e in events if e.startswith("event: progress")]
        assert len(shown) == 1 and '"fraction":0.4' in shown[0] and "page 12/30" in shown[0]
        assert (await env.load(sid)).generation == generation + 1  # only the cancel moved it


async def purge(env: MemEnv, sid: str) -> None:
    """The session ends and retention deletes it, as a sweep a month later does."""
    from datetime import timedelta

    await env.control.cancel(sid, tenant="acme")
    assert (await env.load(sid)).state is SessionState.CANCELLED
    retention = env.services.retention
    assert retention is not None
    now, day = env.clock.now() + timedelta(days=31), timedelta(hours=24)
    report = await retention.sweep(now=now, keep=30 * day, windows=day, limit=10)
    assert report.purged == [("acme", sid)]


@pytest.mark.parametrize("when", ["before-its-first-read", "while-it-waits"])
async def test_a_stream_whose_session_is_deleted_ends_instead_of_raising(when: str) -> None:
    # The route answers 404 for a session it cannot find, but the stream reads the
    # session again after the 200 went out: SessionNotFound raised out of the stream,
    # a traceback in the server's log and a connection cut mid-response. Ended, the
    # client reconnects and is answered 404 (problem+json): the session is gone.
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        assert (await env.load(sid)).state is SessionState.SUSPENDED

        async def gone() -> None:
            await purge(env, sid)

        ticks = Ticks({3: gone})
        streams = SessionStreams(env.control, max_per_tenant=4, sleep=ticks)
        stream = streams.open(sid, "acme", 0)
        if when == "before-its-first-read":
            await gone()  # between the route's look and the stream's first read
        events = [e async for e in stream]
        transitions = [e for e in events if "event: transition" in e]
        if when == "before-its-first-read":
            assert events == []
        else:
            assert ticks.count == 3 and transitions  # what it showed before the purge
        assert streams.streams("acme") == 0  # its slot is back
