"""What an activation does at once: the snapshot is read while the lease is taken, and
the agent's next step is called while the wake that feeds it is being committed (its turn
taken only if the session is still where it was when the step was called)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from actors.wiring import session_runtime
from storage.redis_index import RedisIndex, registry, wire
from tests.support.harness import Env, deliver_cancel, local_env
from torpor.agent import AgentContext, AgentTurn
from torpor.agents.plan import PlanAgent
from torpor.events import InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import Message, SessionSnapshot
from torpor.ports import Reason, TimerKind
from torpor.session import ActivationOutcome
from torpor.session.runtime import lease_name

S = SessionState


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as made:
        yield made


def is_wake_commit(snapshot: SessionSnapshot) -> bool:
    """The commit of a wake that answered the wait: running again, an answer last."""
    return snapshot.state is S.RUNNING and snapshot.messages[-1].role == "tool"


def watch_steps(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once the agent is called on an answer (its step after the wake)."""
    called = asyncio.Event()
    step = PlanAgent.step

    async def watched(self: PlanAgent, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if messages[-1].role == "tool":
            called.set()
        return await step(self, messages, ctx)

    monkeypatch.setattr(PlanAgent, "step", watched)
    return called


async def test_the_next_step_is_called_while_the_wake_is_committed(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = await env.submit()
    assert (await env.load(sid)).state is S.SUSPENDED
    called = watch_steps(monkeypatch)
    save = env.services.snapshots.save

    async def held(snapshot: SessionSnapshot, *, expected_generation: int) -> SessionSnapshot:
        if is_wake_commit(snapshot):
            # The wake's commit lands only once the agent's next step has been called: a
            # runtime that calls the step after the commit never gets there.
            await asyncio.wait_for(called.wait(), timeout=10)
        return await save(snapshot, expected_generation=expected_generation)

    monkeypatch.setattr(env.services.snapshots, "save", held)
    await env.answer(sid, {"status": "approved"})
    snap = await env.load(sid)
    assert snap.state is S.COMPLETED
    # The early call's turn was taken once: never two assistant turns in a row.
    roles = [m.role for m in snap.messages]
    assert "tool" in roles and all(
        (a, b) != ("assistant", "assistant") for a, b in itertools.pairwise(roles)
    )


async def test_the_next_step_has_started_when_the_wake_commit_begins(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store may write the commit on the loop's own thread (the local folder store does
    when it is idle), flush included: the step must already be under way by then, not
    queued behind the flush."""
    sid = await env.submit()
    called = watch_steps(monkeypatch)
    save = env.services.snapshots.save
    at_commit: list[bool] = []

    async def seen(snapshot: SessionSnapshot, *, expected_generation: int) -> SessionSnapshot:
        if is_wake_commit(snapshot):
            at_commit.append(called.is_set())  # no wait: as the commit begins
        return await save(snapshot, expected_generation=expected_generation)

    monkeypatch.setattr(env.services.snapshots, "save", seen)
    await env.answer(sid, {"status": "approved"})
    assert at_commit == [True]
    assert (await env.load(sid)).state is S.COMPLETED


async def test_a_step_called_ahead_is_dropped_when_a_cancel_comes_first(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = await env.submit()
    called = watch_steps(monkeypatch)
    save = env.services.snapshots.save

    async def cancelled_meanwhile(
        snapshot: SessionSnapshot, *, expected_generation: int
    ) -> SessionSnapshot:
        if is_wake_commit(snapshot):
            await asyncio.wait_for(called.wait(), timeout=10)
            await deliver_cancel(env.services, sid, at=env.clock.now())
        return await save(snapshot, expected_generation=expected_generation)

    monkeypatch.setattr(env.services.snapshots, "save", cancelled_meanwhile)
    await env.answer(sid, {"status": "approved"})
    snap = await env.load(sid)
    assert called.is_set()
    assert snap.state is S.CANCELLED
    # The step's turn was never taken: nothing after the answer.
    assert snap.messages[-1].role == "tool"


async def test_a_step_called_ahead_is_dropped_when_the_wake_fails(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = await env.submit()
    called = watch_steps(monkeypatch)
    save = env.services.snapshots.save
    failed: list[Any] = []

    async def failing_once(
        snapshot: SessionSnapshot, *, expected_generation: int
    ) -> SessionSnapshot:
        if is_wake_commit(snapshot) and not failed:
            await asyncio.wait_for(called.wait(), timeout=10)
            failed.append(snapshot)
            raise OSError("the store went away")
        return await save(snapshot, expected_generation=expected_generation)

    monkeypatch.setattr(env.services.snapshots, "save", failing_once)
    await env.answer(sid, {"status": "approved"})  # the activation fails: retried later
    assert failed
    snap = await env.load(sid)
    assert snap.state is S.SUSPENDED  # nothing of that activation, the early step included
    pending = [t for t in asyncio.all_tasks() if "_call_agent" in repr(t.get_coro())]
    assert all(t.done() for t in pending)


async def test_the_snapshot_is_read_while_the_lease_is_taken(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    sid = await env.submit()
    reading, taking = asyncio.Event(), asyncio.Event()
    load, acquire = env.services.snapshots.load, env.services.index.acquire_lease

    async def met_load(session_id: str) -> SessionSnapshot:
        reading.set()
        await asyncio.wait_for(taking.wait(), timeout=10)  # only if the two overlap
        return await load(session_id)

    async def met_acquire(**kw: Any) -> Any:
        taking.set()
        await asyncio.wait_for(reading.wait(), timeout=10)
        return await acquire(**kw)

    monkeypatch.setattr(env.services.snapshots, "load", met_load)
    monkeypatch.setattr(env.services.index, "acquire_lease", met_acquire)
    runtime = session_runtime(env.services, "test-overlap")
    result = await runtime.activate(sid, reason=Reason.EVENT)
    assert result.outcome is ActivationOutcome.RAN
    assert reading.is_set() and taking.is_set()


async def test_a_busy_session_drops_the_read_it_started(env: Env) -> None:
    sid = await env.submit()
    held = await env.services.index.acquire_lease(
        name=lease_name(sid), owner="someone-else", ttl=timedelta(minutes=1), now=env.clock.now()
    )
    assert held is not None
    runtime = session_runtime(env.services, "test-busy")
    result = await runtime.activate(sid, reason=Reason.EVENT)
    assert result.outcome is ActivationOutcome.BUSY
    assert not [t for t in asyncio.all_tasks() if "load" in repr(t.get_coro()) and not t.done()]


def record_round_trips(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[Any, ...]]]:
    """The index's commands as they leave on its lean connection, grouped by round trip:
    a command written before any reply came back since the last one shares its trip."""
    trips: list[list[tuple[Any, ...]]] = []
    replies = [0]
    last_seen = [-1]
    write, received = wire.WireConnection.write, wire._Replies.data_received

    def written(
        self: wire.WireConnection, commands: list[tuple[Any, ...]], into: Any = None
    ) -> Any:
        if not trips or last_seen[0] != replies[0]:
            trips.append([])
        trips[-1].extend(commands)
        last_seen[0] = replies[0]
        return write(self, commands, into)

    def read(self: Any, data: bytes) -> None:
        replies[0] += 1
        received(self, data)

    monkeypatch.setattr(wire.WireConnection, "write", written)
    monkeypatch.setattr(wire._Replies, "data_received", read)
    return trips


async def test_a_resume_shares_its_index_round_trips(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wake's record of the new state goes with the unbind of the wait it answered, in
    one round trip, and the unbind does not read the binding first (the wait's deadline
    names its keys); the lease's release goes with the wake-up timer's removal."""
    sid = await env.submit()
    snap = await env.load(sid)
    wait = snap.waits[0]
    index = env.services.index
    assert isinstance(index, RedisIndex)
    keys = index.keys

    def named(command: tuple[Any, ...]) -> str:
        """What a command does, by the first key it names."""
        first = str(command[3] if command[0] == "EVALSHA" else command[1])
        return {
            keys.correlation(wait.correlation_id): "HGET binding"
            if command[0] == "HGET"
            else "unbind",
            keys.session_state: "record state",
            keys.lease(lease_name(sid)): "lease",
            keys.timers(TimerKind.WAKE): f"{command[0]} wake-up",
        }.get(first, first)

    trips = record_round_trips(monkeypatch)
    deliver = env.control.deliver

    async def delivered(event: InboxEvent) -> bool:
        # From the delivery on: the harness's own lookup of the binding is not the resume's.
        trips.clear()
        return await deliver(event)

    monkeypatch.setattr(env.control, "deliver", delivered)
    assert await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is S.COMPLETED
    named_trips = [sorted(named(c) for c in trip) for trip in trips]
    assert ["record state", "unbind"] in named_trips, named_trips
    assert not any("HGET binding" in trip for trip in named_trips), named_trips
    # The last of the activation: the lease (acquired earlier, released now) and the
    # wake-up's removal, together.
    assert ["ZREM wake-up", "lease"] in named_trips, named_trips


async def test_an_activation_with_nothing_to_commit_lifts_a_quarantine_in_its_last_trip(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index says QUARANTINED (its snapshot did not decode), the snapshot reads now and
    the activation has nothing to commit: the quarantine is lifted in the round trip that
    releases the lease, not one of its own, and so is the read of what refused it, if
    anything did (``let_go``). Such an activation makes the two round trips it made
    before (the lease's, then its release with the wake-up's removal)."""
    sid = await env.submit()
    snap = await env.load(sid)
    index = env.services.index
    assert isinstance(index, RedisIndex)
    # What an activation that found it undecodable recorded, before it was restored.
    await index.record_session(
        tenant=snap.tenant, session_id=sid, state=S.QUARANTINED, generation=snap.generation
    )

    def named(command: tuple[Any, ...]) -> str:
        # By its source: where it stands in the batch, even on a server that forgot it
        # (``RedisConnection.ordered_script``).
        if command[0] == "EVAL" and command[1] == registry._LIFT:
            return "lift"
        first = str(command[3] if command[0] == "EVALSHA" else command[1])
        return {
            index.keys.lease(lease_name(sid)): "lease",
            index.keys.timers(TimerKind.WAKE): f"{command[0]} wake-up",
            # The quarantine's generation, read after the lift in case it refused it.
            index.keys.session_state: f"{command[0]} state",
        }.get(first, first)

    trips = record_round_trips(monkeypatch)
    runtime = session_runtime(env.services, "test-lift")
    result = await runtime.activate(sid, reason=Reason.EVENT)
    assert result.outcome is ActivationOutcome.RAN and result.generation == snap.generation
    assert [sorted(named(c) for c in trip) for trip in trips] == [
        ["lease"],
        ["HGET state", "ZREM wake-up", "lease", "lift"],
    ]
    assert (await index.session_states([sid]))[sid] is S.SUSPENDED
