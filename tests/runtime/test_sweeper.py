"""The reconciler's sweep consumes nothing before its work is confirmed.

Each test takes one kind of due work (a retry timer, an expired lease, a delivery timer,
a finished session's outbox, a pending delivery after index loss), makes the work fail
or vanish the way it does in production (an activation request nobody takes, storage
failing mid-attempt, a flushed index), and checks the work comes back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.conftest import eventually
from tests.support.harness import Env, held_by_a_dead_holder, local_env
from tests.support.receiver import Receiver
from torpor.auth import new_api_key
from torpor.deliveries import DeliveryStatus
from torpor.errors import ActivationUnavailable, StorageUnavailable
from torpor.ids import new_correlation_id
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, Wait
from torpor.ports import Observer, Reason, TimerKind, WaitBinding
from torpor.service.sessions import SessionService
from torpor.service.sweeper import POLLS_AT_ONCE, Sweeper, SweepReport
from torpor.tools import PollOutcome

FAR = timedelta(days=365)


class Unavailable:
    """An activator whose every request fails (no actor could be started)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Reason]] = []

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        self.requests.append((session_id, reason))
        raise ActivationUnavailable(f"no actor for {session_id}")


class Recording(Unavailable):
    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        self.requests.append((session_id, reason))


class Steps(Observer):
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.completed = 0

    async def sweep_step_failed(self, step: str) -> None:
        self.failed.append(step)

    async def sweep_completed(self, *, started_at: float, duration_s: float) -> None:
        self.completed += 1


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


def sweeper(env: Env, activator: object | None = None) -> Sweeper:
    if activator is None:
        return Sweeper(env.control)
    return Sweeper(SessionService(env.services, activator))  # type: ignore[arg-type]


async def due(env: Env, kind: TimerKind, after: timedelta = timedelta(0)) -> list[str]:
    return await env.services.index.due(kind=kind, now=env.clock.now() + after, limit=100)


async def flush_index(redis_url: str, prefix: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    keys = [key async for key in client.scan_iter(match=prefix + "*", count=1000)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def finished(env: Env, url: str) -> str:
    sid = await env.submit(doc="PR-N", callback_url=url)
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    return sid


# -- step isolation ---------------------------------------------------------------------


async def test_a_failing_step_is_logged_and_counted_and_the_others_still_run(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    steps = env.services.observer = Steps()
    sid = await env.submit()
    await env.services.index.schedule(kind=TimerKind.RETRY, member=sid, at=env.clock.now())

    async def broken(**_: object) -> list[object]:
        raise RuntimeError("a bug in one step")

    monkeypatch.setattr(env.services.index, "due_deadlines", broken)
    report = await sweeper(env).sweep_once()
    assert report.retried == 1, "the steps after the failing one still ran"
    assert steps.failed == ["deadlines"] and report.errors[0].startswith("deadlines: ")
    assert any(r.exc_info for r in caplog.records), "logged with its traceback"
    assert steps.completed == 0 and await env.services.index.last_sweep() is None
    monkeypatch.undo()
    await sweeper(env).sweep_once()
    last = await env.services.index.last_sweep()
    assert steps.completed == 1 and last is not None
    assert abs(last - env.clock.now()) < timedelta(milliseconds=1)


# -- retry timers -----------------------------------------------------------------------


async def test_a_retry_timer_stays_until_an_activation_request_is_taken(env: Env) -> None:
    sid = await env.submit()
    index = env.services.index
    await index.schedule(kind=TimerKind.RETRY, member=sid, at=env.clock.now())
    gone = sweeper(env, Unavailable())
    await gone.sweep_once()
    assert await due(env, TimerKind.RETRY) == [], "leased while the request is tried"
    assert await due(env, TimerKind.RETRY, gone.timer_lease) == [sid], "not consumed"
    env.clock.advance(gone.timer_lease.total_seconds())
    report = await sweeper(env).sweep_once()
    assert report.retried == 1
    assert await due(env, TimerKind.RETRY, FAR) == [], "removed once the request was taken"


async def test_a_retry_the_session_asks_for_meanwhile_is_kept(env: Env) -> None:
    index, later = env.services.index, env.clock.now() + timedelta(seconds=100)

    class AsksAgain(Recording):
        async def request(
            self, session_id: str, *, reason: Reason, agent: str | None = None
        ) -> None:
            await index.schedule(kind=TimerKind.RETRY, member=session_id, at=later)

    await index.schedule(kind=TimerKind.RETRY, member="s_x", at=env.clock.now())
    await sweeper(env, AsksAgain()).sweep_once()
    assert await due(env, TimerKind.RETRY, timedelta(seconds=100)) == ["s_x"]


# -- lease entries ----------------------------------------------------------------------


async def test_an_expired_lease_is_forgotten_only_once_its_recovery_was_taken(env: Env) -> None:
    sid, index = await env.submit(), env.services.index
    name = f"session:{sid}"
    await held_by_a_dead_holder(env, sid)
    env.clock.advance(3)
    await sweeper(env, Unavailable()).sweep_once()
    assert await index.expired_leases(now=env.clock.now(), limit=10) == [name]
    report = await sweeper(env).sweep_once()
    assert report.recovered == 1
    assert await index.expired_leases(now=env.clock.now(), limit=10) == []


# -- requests taken, then lost -----------------------------------------------------------
#
# "Taken" is only queued: a pool host takes a request off its channel, then dies before it
# leases the session. What made the sweep ask (a retry timer, an expired lease's entry, a
# lost index) was let go once the request was taken, so nothing asked again and the
# session stayed RUNNING for ever (the chaos run, host 1 killed). Each such request now
# arms the session's wake-up timer first.


class Lost(Recording):
    """Takes every request, then loses it: a host killed after it took it off its channel."""


async def asked_again_after_the_grace(env: Env, sid: str) -> None:
    index = env.services.index
    assert await due(env, TimerKind.WAKE) == [], "not before the grace"
    env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
    again = Lost()
    await sweeper(env, again).sweep_once()
    assert (sid, Reason.EVENT) in again.requests, again.requests
    # Left armed (leased forward) until an activation runs to its end: then it goes.
    await env.control.activate(sid, reason=Reason.EVENT)
    assert await index.due(kind=TimerKind.WAKE, now=env.clock.now() + FAR, limit=9) == []


async def test_a_recovery_taken_then_lost_is_asked_for_again(env: Env) -> None:
    sid, index = await env.submit(), env.services.index
    await held_by_a_dead_holder(env, sid)
    lost = Lost()
    await sweeper(env, lost).sweep_once()
    assert (sid, Reason.RECOVER) in lost.requests
    assert await index.expired_leases(now=env.clock.now(), limit=10) == [], "forgotten"
    await asked_again_after_the_grace(env, sid)


async def test_a_retry_taken_then_lost_is_asked_for_again(env: Env) -> None:
    sid, index = await env.submit(), env.services.index
    await index.schedule(kind=TimerKind.RETRY, member=sid, at=env.clock.now())
    lost = Lost()
    await sweeper(env, lost).sweep_once()
    assert (sid, Reason.RETRY) in lost.requests
    assert await due(env, TimerKind.RETRY, FAR) == [], "removed once taken"
    await asked_again_after_the_grace(env, sid)


async def test_a_repairs_request_taken_then_lost_is_asked_for_again(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    # Submitted, never activated (its request lost too): PENDING in the store.
    made = await SessionService(env.services, Lost()).submit(  # type: ignore[arg-type]
        tenant="acme", agent="purchase", input={"doc": "PR-1", "amount": 100.0}
    )
    sid = made.session_id
    await flush_index(redis_url, redis_prefix)  # its wake-up timer with it
    lost = Lost()
    report = await sweeper(env, lost).sweep_once()
    assert report.repaired_sessions == 1 and (sid, Reason.SUBMIT) in lost.requests
    await asked_again_after_the_grace(env, sid)
    assert (await env.load(sid)).state is SessionState.SUSPENDED


async def test_a_periodic_repair_of_an_intact_index_arms_no_wake_up(env: Env) -> None:
    """Its leases and timers are there: a session it asks for may be running (held by a
    live activation), and a wake-up armed under it would come back every grace, busy."""
    made = await SessionService(env.services, Lost()).submit(  # type: ignore[arg-type]
        tenant="acme", agent="purchase", input={"doc": "PR-2", "amount": 100.0}
    )
    index = env.services.index
    await sweeper(env, Lost()).sweep_once()  # the first repair notes the index intact
    assert await index.is_intact()
    await index.unschedule(kind=TimerKind.WAKE, member=made.session_id)
    lost = Lost()
    report = await sweeper(env, lost).sweep_once()  # a new sweeper repairs at once
    assert report.repaired_sessions == 1 and (made.session_id, Reason.SUBMIT) in lost.requests
    assert await index.due(kind=TimerKind.WAKE, now=env.clock.now() + FAR, limit=9) == []


async def test_a_holder_that_died_after_its_commit_leaves_the_registry_right(
    env: Env,
) -> None:
    """It committed a new state and died before the registry's record of it (the next
    round trip). Whoever takes its lease over records the state it finds."""
    sid, index = await env.submit(), env.services.index
    snap = await env.load(sid)
    await index.forget_session(tenant="acme", session_id=sid)
    await index.record_session(
        tenant="acme", session_id=sid, state=SessionState.RUNNING, generation=snap.generation - 1
    )
    await held_by_a_dead_holder(env, sid)
    await env.control.activate(sid, reason=Reason.RECOVER)
    assert await index.session_states([sid]) == {sid: SessionState.SUSPENDED}


# -- delivery timers --------------------------------------------------------------------


async def test_a_delivery_timer_stays_until_its_attempt_settled(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = Receiver()
    try:
        sid = await finished(env, hook.url)
        store = env.services.deliveries
        real_update = store.update

        async def failing_update(*args: object, **kwargs: object) -> object:
            raise StorageUnavailable("object store unreachable mid-attempt")

        monkeypatch.setattr(store, "update", failing_update)
        first = sweeper(env)
        await first.sweep_once()
        await first.deliveries.drain()
        lease = first.deliveries.lease
        assert await due(env, TimerKind.DELIVER) == []
        assert len(await due(env, TimerKind.DELIVER, lease)) == 1, "not consumed"
        monkeypatch.setattr(store, "update", real_update)
        env.clock.advance(lease.total_seconds())
        second = sweeper(env)
        await second.sweep_once()
        await second.deliveries.drain()
        [delivery], _ = await store.list("acme", status=None, cursor=None, limit=5)
        assert delivery.session_id == sid and delivery.status is DeliveryStatus.DELIVERED
        assert await due(env, TimerKind.DELIVER, FAR) == [], "removed once settled"
    finally:
        hook.close()


# -- repair -----------------------------------------------------------------------------


async def test_repair_brings_back_a_finished_sessions_pending_outbox(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    hook = Receiver()
    try:
        sid = await finished(env, hook.url)
        snap = await env.load(sid)
        owed = [e.model_copy(update={"status": DispatchStatus.PENDING}) for e in snap.outbox]
        await env.services.snapshots.save(
            snap.model_copy(update={"outbox": owed, "generation": snap.generation + 1}),
            expected_generation=snap.generation,
        )
        await flush_index(redis_url, redis_prefix)  # its retry timer went with the index
        activator = Recording()
        await sweeper(env, activator).sweep_once()
        assert (sid, Reason.REPAIR) in activator.requests
    finally:
        hook.close()


async def test_repair_rebuilds_the_timer_of_a_resent_delivery_of_a_long_ended_session(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Repair walks only the sessions that are live or ended within the binding grace,
    and looked for pending deliveries only in their tenants: an operator's resend of an
    older session's delivery lost its timer with the index, and stayed pending for good
    (which also kept its session from retention)."""
    _, key_hash = new_api_key()
    extra = {"tenants": {"acme": {"api_keys": [key_hash]}}}
    hook = Receiver(script=[410, 200])  # disabled at first: an operator resends it later
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
            await finished(env, hook.url)
            swept = sweeper(env)
            await swept.sweep_once()
            await swept.deliveries.drain()
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=DeliveryStatus.DISABLED, cursor=None, limit=10
            )
            grace = env.services.settings.storage.binding_grace_s
            env.clock.advance(grace + 2 * 24 * 3600)  # past the ended markers' day, too
            await swept.deliveries.resend("acme", delivery.delivery_id, now=env.clock.now())
            await flush_index(redis_url, redis_prefix)
            await swept.sweep_once()  # the repair; then the delivery is attempted again
            await swept.deliveries.drain()
            assert len(hook.received) == 2, "the resent delivery was found and attempted"
    finally:
        hook.close()


async def test_repair_rebuilds_delivery_timers(env: Env, redis_url: str, redis_prefix: str) -> None:
    hook = Receiver()
    try:
        await finished(env, hook.url)
        assert len(await due(env, TimerKind.DELIVER)) == 1
        await flush_index(redis_url, redis_prefix)
        swept = sweeper(env)
        await swept.sweep_once()
        await swept.deliveries.drain()
        assert len(hook.received) == 1, "the pending delivery was found and attempted"
    finally:
        hook.close()


async def test_a_due_binding_of_a_session_that_is_gone_is_unbound_not_timed_out_for_ever(
    env: Env,
) -> None:
    """A wait's binding outlives its session when the session ended and its process died
    before the unbind, and retention deleted the session before the wait's deadline (an
    SLA of weeks). Due, it asked for a timeout activation, which found no session, at
    every sweep and four times a second until the binding's grace ran out a week later."""
    now = env.clock.now()
    binding = WaitBinding(
        tenant="acme",
        correlation_id=new_correlation_id(),
        session_id="s_purged",
        epoch=1,
        step_id="2",
        deadline=now + timedelta(seconds=60),
    )
    grace = timedelta(days=7)
    await env.services.index.bind_wait(binding, business_key=None, grace=grace, now=now)
    env.clock.advance(61)
    activator = Recording()
    report = await sweeper(env, activator).sweep_once()
    assert report.errors == [] and activator.requests == []
    assert await env.services.index.due_deadlines(now=env.clock.now(), limit=10) == []


async def test_a_poll_answered_after_the_deadline_does_not_resume_the_wait(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll's answer is received when the poll returns, not when the sweep started: the
    sweep's earlier steps (a repair, the deliveries) and the poll itself (up to 30 s) can
    take the time past the wait's deadline. Stamped with the sweep's start, an answer the
    far side gave after the deadline passed the SLA gate and completed the session."""
    sid = await env.submit(doc="PR-LATE")
    [wait] = (await env.load(sid)).waits
    await env.world.decide("PR-LATE", {"status": "approved"})
    env.clock.advance((wait.deadline - env.clock.now()).total_seconds() - 1)
    tool = env.services.plugins.agent("purchase").tools.get(wait.tool_name)
    asked = tool.poll  # type: ignore[union-attr]

    async def slow_poll(polled: Wait, *, tenant: str) -> PollOutcome | None:
        env.clock.advance(5)  # the far side answers, after the deadline
        return await asked(polled, tenant=tenant)

    monkeypatch.setattr(tool, "poll", slow_poll)
    report = await sweeper(env).sweep_once(env.clock.now())
    assert (report.polls, report.poll_hits, report.errors) == (1, 1, [])
    done = await env.load(sid)
    assert done.state is SessionState.TIMED_OUT and done.error is not None
    assert done.error.code == "sla_expired"


async def test_two_reconcilers_sweeping_at_once_ask_the_vendor_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted reconciler beside the old one: both read the same due poll entry and
    both asked the vendor. The entry is now taken by the first; the second finds none."""
    sid = await env.submit(doc="PR-POLL")
    [wait] = (await env.load(sid)).waits
    env.clock.advance((wait.deadline - env.clock.now()).total_seconds() - 1)
    tool = env.services.plugins.agent("purchase").tools.get(wait.tool_name)
    asked: list[str] = []
    release = asyncio.Event()

    async def slow_poll(polled: Wait, *, tenant: str) -> PollOutcome | None:
        asked.append(polled.correlation_id)
        await release.wait()  # the vendor takes its time
        return None

    monkeypatch.setattr(tool, "poll", slow_poll)
    now = env.clock.now()
    first = asyncio.create_task(sweeper(env)._polls(now, SweepReport()))
    await eventually(lambda: len(asked) == 1)
    second = SweepReport()
    await sweeper(env)._polls(now, second)
    release.set()
    await first
    assert asked == [wait.correlation_id] and second.polls == 0


async def test_a_sweep_polls_a_bounded_number_at_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sids = [await env.submit(doc=f"PR-P{i}") for i in range(20)]
    deadline = min([(await env.load(s)).waits[0].deadline for s in sids])
    env.clock.advance((deadline - env.clock.now()).total_seconds() - 1)
    tool = env.services.plugins.agent("purchase").tools.get("request_approval")
    in_flight, most = [0], [0]

    async def counted_poll(polled: Wait, *, tenant: str) -> PollOutcome | None:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        await asyncio.sleep(0.01)
        in_flight[0] -= 1
        return None

    monkeypatch.setattr(tool, "poll", counted_poll)
    report = SweepReport()
    await sweeper(env)._polls(env.clock.now(), report)
    assert report.polls == 20 and most[0] == POLLS_AT_ONCE
