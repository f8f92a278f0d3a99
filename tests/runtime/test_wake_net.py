"""The sweep's wake-up net (a request taken, then lost) against the paths that end an
activation without running it to its end: none of them may leave the net armed for
ever, and the net must not cost what a lease taken over is meant to repair."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from pydantic import JsonValue

from actors.wiring import session_runtime
from storage import keys
from storage.codec import SnapshotCodec
from tests.conftest import eventually
from tests.runtime.memory_env import memory_env, plan_agent, reset
from tests.runtime.test_agent_backend_errors import AGENTS as FLAKY
from tests.runtime.test_agent_backend_errors import FlakyBackend
from tests.support.harness import held_by_a_dead_holder, local_env
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.errors import StorageUnavailable
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION, Message, SessionSnapshot
from torpor.ports import Reason, TimerKind
from torpor.service.sweeper import Sweeper
from torpor.session import ActivationOutcome

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


async def test_a_takeover_that_failed_before_its_record_leaves_the_next_one_to_make_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """``Lease.taken_over`` is told once, to the first holder after the dead one. That
    holder failed before it re-recorded the state (the store did not answer its read)
    and released the lease: the next holder took a released lease, was told nothing,
    and the registry kept the dead holder's old state until the hourly full repair."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid, index = await env.submit(), env.services.index
        snap = await env.load(sid)
        await index.forget_session(tenant="acme", session_id=sid)
        await index.record_session(
            tenant="acme",
            session_id=sid,
            state=SessionState.RUNNING,
            generation=snap.generation - 1,
        )
        await held_by_a_dead_holder(env, sid)
        snapshots = env.services.snapshots
        real = snapshots.load
        calls = 0

        async def unsteady(session_id: str) -> SessionSnapshot:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise StorageUnavailable("the store did not answer")
            return await real(session_id)

        runtime = session_runtime(env.services, "test-runtime")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(snapshots, "load", unsteady)
            with pytest.raises(StorageUnavailable):
                await runtime.activate(sid, reason=Reason.RECOVER)
        # Its retry (or, were the lease left to expire, the recovery) comes round.
        outcomes: list[ActivationOutcome] = []

        async def taken() -> bool:
            outcomes.append((await runtime.activate(sid, reason=Reason.RETRY)).outcome)
            return outcomes[-1] is not ActivationOutcome.BUSY

        await eventually(taken, timeout_s=10, interval_s=0.1, what="the lease came free")
        assert outcomes[-1] is ActivationOutcome.RAN
        assert await index.session_states([sid]) == {sid: SessionState.SUSPENDED}


class CancelledWhileFailing:
    """Its backend refuses every step; while the first refusal is on its way, the
    session's user cancels it (the cancel finds the session busy: its lease is held)."""

    name = "cancelled"
    version = "1"
    CANCEL: ClassVar[list[Callable[[str], Awaitable[object]]]] = []

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        while self.CANCEL:
            await self.CANCEL.pop(0)(ctx.session_id)
        raise httpx.ConnectError("[Errno 111] Connection refused")


CANCELLED = {"cancelled": {"factory": "tests.runtime.test_wake_net:CancelledWhileFailing"}}


async def test_a_cancel_that_came_while_the_activation_failed_is_not_held_back() -> None:
    """``Retrier.later`` drops the wake-up so that only the retry, after its backoff,
    brings the session back. A cancel delivered while that activation ran found it busy
    (no re-check follows a STOPPED activation) and had armed that very wake-up: it was
    dropped with it, and the cancel waited out the whole backoff (up to
    ``retry_backoff_cap_s``, ten minutes) instead of the grace."""
    async with memory_env(CANCELLED, retry_backoff_base_s=300.0) as env:
        reset()
        sweep = Sweeper(env.control)
        await sweep.sweep_once()  # its first full repair: out of the way
        CancelledWhileFailing.CANCEL[:] = [env.control.cancel]
        sid = await env.submit("cancelled")
        snap = await env.load(sid)
        assert snap.state is SessionState.RUNNING and snap.retry.used == 1
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        await sweep.sweep_once()
        assert (await env.load(sid)).state is SessionState.CANCELLED


async def test_a_takeover_left_to_a_newer_torpor_is_told_to_it() -> None:
    """A newer torpor's holder died holding the lease (perhaps between its commit and
    the registry's record). An older one took the lease over, could not read the
    snapshot to record its state, and released the lease: the newer holder that came
    next took a released lease, was told nothing, and the registry kept the dead
    holder's old state until the hourly full repair. Such a lease is now kept until it
    expires, as for any takeover whose record was not made."""
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        newer = (await env.load(sid)).model_copy(update={"schema_version": SCHEMA_VERSION + 1})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        index, ttl = env.services.index, env.services.config.lease_ttl
        dead = await index.acquire_lease(
            name=f"session:{sid}", owner="newer-host", ttl=ttl, now=env.clock.now()
        )
        assert dead is not None
        env.clock.advance(ttl.total_seconds() + 1)  # it died: its lease expired unreleased
        result = await env.runtime.activate(sid, reason=Reason.RECOVER)
        assert result.outcome is ActivationOutcome.STOPPED
        env.clock.advance(ttl.total_seconds() + 1)
        after = await index.acquire_lease(
            name=f"session:{sid}", owner="newer-host-2", ttl=ttl, now=env.clock.now()
        )
        assert after is not None
        assert after.taken_over, "the newer holder after the old one was not told"
