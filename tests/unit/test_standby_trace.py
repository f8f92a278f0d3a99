"""A session handed to a standby actor runs in the trace of the request that handed it
over, as one started under its own name does (pure code, no Ray started: the actors,
their services and Ray's context are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors import session_actor, wiring
from actors.session_actor import SessionActor
from tests.unit.test_standby_routing import Actor, activator_with_standbys
from torpor import tracing
from torpor.ports import Reason
from torpor.session import ActivationOutcome, ActivationResult

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_standby_adopts_a_session_with_the_requesters_traceparent() -> None:
    """The adoption carried no traceparent: the adopted session's spans started a trace
    of their own, cut off from the webhook or submit that woke it."""
    activator, standby = activator_with_standbys(Actor())
    async with asyncio.timeout(5):
        await standby.filled(timeout_s=5)
        (taken,) = standby._ready
        with tracing.continued(TRACEPARENT):
            await activator.request("s_1", reason=Reason.EVENT)
    assert [call[-1] for call in taken.adopt.calls] == [TRACEPARENT]
    taken.slept.set_result(None)
    await standby.close()


async def test_a_request_to_an_adopted_actor_carries_the_requesters_traceparent() -> None:
    """A second request while the adopted actor runs goes to it, traceparent and all."""
    activator, standby = activator_with_standbys(Actor())
    async with asyncio.timeout(5):
        await standby.filled(timeout_s=5)
        (taken,) = standby._ready
        await activator.request("s_1", reason=Reason.SUBMIT)
        with tracing.continued(TRACEPARENT):
            await activator.request("s_1", reason=Reason.EVENT)
    assert [call[-1] for call in taken.activate.calls] == [TRACEPARENT]
    taken.slept.set_result(None)
    await standby.close()


class TracedRuntime:
    """A session runtime that notes the trace each activation runs in."""

    def __init__(self) -> None:
        self.traces: list[str | None] = []

    async def activate(self, session_id: str, **_: Any) -> ActivationResult:
        self.traces.append(tracing.traceparent())
        return ActivationResult(session_id, ActivationOutcome.SUSPENDED)


class ClosingServices:
    async def close(self) -> None:
        pass


async def test_an_adopted_session_runs_in_the_trace_its_adoption_carried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The standby's ``adopt`` took no traceparent: its activation ran outside the
    requester's trace even where one was sent."""
    runtime = TracedRuntime()
    monkeypatch.setattr(wiring, "session_runtime", lambda services, owner: runtime)
    context = SimpleNamespace(get_node_id=lambda: "node0000ffff")
    monkeypatch.setattr(session_actor.ray, "get_runtime_context", lambda: context)
    cls: Any = SessionActor.__ray_actor_class__  # type: ignore[attr-defined]
    actor = cls.__new__(cls)  # a standby as its constructor leaves it, services open
    actor._session_id, actor._services, actor._wanted = None, ClosingServices(), []
    actor._closing, actor._task, actor._done = False, None, asyncio.Event()
    actor._idle = None
    actor._exit = lambda: None
    assert await actor.adopt("s_1", "event", None, TRACEPARENT) == "accepted"
    async with asyncio.timeout(5):
        await actor._task
    assert runtime.traces == [TRACEPARENT]
