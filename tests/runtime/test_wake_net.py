"""The sweep's wake-up net (a request taken, then lost) against the paths that end an
activation without running it to its end: none of them may leave the net armed for
ever, and the net must not cost what a lease taken over is meant to repair."""

from __future__ import annotations

from datetime import timedelta

import httpx

from storage import keys
from storage.codec import SnapshotCodec
from tests.runtime.memory_env import memory_env, plan_agent, reset
from tests.runtime.test_agent_backend_errors import AGENTS as FLAKY
from tests.runtime.test_agent_backend_errors import FlakyBackend
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION
from torpor.ports import TimerKind
from torpor.service.sweeper import Sweeper

PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
AGENTS = {"a": plan_agent(PLAN, {"tests.runtime.memory_env:Approve": {}})}


async def test_a_snapshot_from_a_newer_torpor_retried_by_its_timer_is_not_woken_every_grace() -> (
    None
):
    """``_leave_to_newer`` retries at the backoff's cap, not every sweep. Its retry timer
    fired, the sweep's net armed a wake-up, and the STOPPED activation left it: the
    session was activated every ``wake_grace_s`` for as long as no newer torpor took it
    (each pushing its retry timer out again), not once every ten minutes."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        newer = (await env.load(sid)).model_copy(update={"schema_version": SCHEMA_VERSION + 1})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        index, cap = env.services.index, env.services.config.retry_cap
        await index.unschedule(kind=TimerKind.WAKE, member=sid)
        await index.schedule(kind=TimerKind.RETRY, member=sid, at=env.clock.now())
        report = await Sweeper(env.control).sweep_once()
        assert report.retried == 1
        soon = env.clock.now() + cap * 0.7
        assert await index.due(kind=TimerKind.RETRY, now=soon, limit=9) == []
        assert await index.due(kind=TimerKind.WAKE, now=soon, limit=9) == [], (
            "woken every wake_grace_s instead of at the backoff's cap"
        )
        # And again a grace later: the sweep does not ask for it.
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        assert (await Sweeper(env.control).sweep_once()).woken == 0


async def test_a_session_set_aside_by_its_retry_is_not_woken_again() -> None:
    """``Retrier.quarantine``: "no timer brings it back". Its last retry was asked for by
    the sweep, whose net armed a wake-up; the quarantine ends the activation STOPPED,
    which left it: the set-aside session was activated once more a grace later."""
    async with memory_env(FLAKY) as env:
        reset()
        FlakyBackend.FAILURES[:] = [httpx.ConnectError("refused")] * 50
        sid = await env.submit("flaky")
        index, sweep = env.services.index, Sweeper(env.control)
        await sweep.sweep_once()  # its first full repair: out of the way
        for _ in range(50):  # each retry asked for by the sweep, as in production
            if (await env.load(sid)).state is SessionState.QUARANTINED:
                break
            env.clock.advance(env.services.config.retry_cap.total_seconds() * 1.3)
            assert (await sweep.sweep_once()).woken == 0
        assert (await env.load(sid)).state is SessionState.QUARANTINED
        far = env.clock.now() + timedelta(days=365)
        assert await index.due(kind=TimerKind.RETRY, now=far, limit=9) == []
        assert await index.due(kind=TimerKind.WAKE, now=far, limit=9) == [], "woken again"
