"""kill -9 of the session process while a fan-in group resolves, then recovery.

The group (``any`` of three vendor quotes) is opened by this test process; the session
process is started to deliver one member's answer and dies at a named point: right after
the commit that resolved the group (closed members still bound, their undos not sent),
or right after the first undo went out (its status not committed). The reconciler's sweep
then finishes the work from durable state: the agent gets the answer, and each closed
member is undone once on the far side (one effect per idempotency key).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.wiring import open_services, session_runtime
from tests.faults.test_session_crashes import FAST, Crash
from tests.support.harness import settings_for
from tests.support.tools import World, quotes_agent
from torpor.clock import SystemClock
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason, OutboxKind, SessionSnapshot, Wait
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper

pytestmark = pytest.mark.slow

S = SessionState
UNDO = {v: f"acme:quote:{v}:1:compensate" for v in "abc"}


@pytest.fixture
async def crash(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Crash]:
    extra = {**FAST, "agents": quotes_agent(redis_url, redis_prefix, {"condition": "any"})}
    settings = settings_for(tmp_path, redis_url, redis_prefix, extra=extra)
    services = open_services(settings, clock=SystemClock())
    control = SessionService(services, InlineActivator(session_runtime(services, "rescuer")))
    world = World(redis_url, redis_prefix)
    yield Crash(tmp_path, redis_url, redis_prefix, {}, services, control, Sweeper(control), world)
    await world.close()
    await services.close()


def quote(snap: SessionSnapshot, wait: Wait, price: int, event_id: str) -> dict[str, Any]:
    event = InboxEvent.answering(
        wait,
        kind=EventKind.CALLBACK,
        session_id=snap.session_id,
        source="vendor",
        event_id=event_id,
        type="vendor.quote",
        received_at=snap.updated_at,
        data={"price": price},
    )
    return event.model_dump(mode="json")


async def open_group(crash: Crash) -> SessionSnapshot:
    submitted = await crash.control.submit(tenant="acme", agent="quotes", input=None)
    snap = await crash.load(submitted.session_id)
    assert snap.state is S.SUSPENDED and len(snap.waits) == 3
    return snap


def member(snap: SessionSnapshot, vendor: str) -> Wait:
    return next(w for w in snap.waits if w.request["vendor"] == vendor)


def finished(snap: SessionSnapshot) -> bool:
    return snap.state is S.COMPLETED and not snap.pending_outbox()


async def deliver_and_die(crash: Crash, snap: SessionSnapshot, point: str) -> SessionSnapshot:
    extra = {**FAST, "agents": quotes_agent(crash.redis_url, crash.prefix, {"condition": "any"})}
    event = quote(snap, member(snap, "b"), 20, "quote-b")
    await crash.kill_at(point, "deliver", event=event, extra=extra)
    return await crash.load(snap.session_id)


async def test_kill_after_the_commit_that_resolved_the_group(crash: Crash) -> None:
    snap = await open_group(crash)
    dead = await deliver_and_die(crash, snap, CrashPoint.WAKE_COMMITTED)
    # resolved durably: the answer is the call's result, the group and its waits are gone,
    # the undos of the closed members are owed, none sent yet
    assert dead.fan_ins == [] and dead.waits == [] and dead.state is S.RUNNING
    owed = sorted(
        e.idempotency_key for e in dead.pending_outbox() if e.kind is OutboxKind.COMPENSATE
    )
    assert owed == [UNDO["a"], UNDO["c"]]
    assert await crash.world.counts("compensate") == {}
    done = await crash.recover(snap.session_id, finished)
    assert done.lease_fence > dead.lease_fence
    assert done.result is not None and done.result["answers"] == {"b": {"price": 20}}  # type: ignore[index,call-overload]
    assert await crash.world.counts("compensate") == {UNDO["a"]: 1, UNDO["c"]: 1}
    # a late quote from a closed member is observed, never applied, never undone again
    await crash.control.deliver(
        InboxEvent.model_validate(quote(snap, member(snap, "a"), 5, "quote-a"))
    )
    after = await crash.load(snap.session_id)
    assert after.result == done.result
    assert after.observations[-1].reason is ObservationReason.LATE
    assert await crash.world.counts("compensate") == {UNDO["a"]: 1, UNDO["c"]: 1}


async def test_kill_after_the_first_undo_went_out(crash: Crash) -> None:
    snap = await open_group(crash)
    dead = await deliver_and_die(crash, snap, CrashPoint.COMPENSATE_SENT)
    assert dead.fan_ins == [] and len(await crash.world.entries("compensate")) == 1
    await crash.recover(snap.session_id, finished)
    # resent under the same key: the far side applied each undo once
    assert sorted(await crash.world.entries("compensate")) == [UNDO["a"], UNDO["c"]]
    assert sum((await crash.world.counts("compensate")).values()) == 3
