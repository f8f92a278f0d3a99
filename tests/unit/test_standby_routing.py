"""Which actor a dedicated session's request goes to when the activator keeps standbys
(pure code, no Ray started: the actors are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors import ray_activator
from actors.ray_activator import Admission, RayActivator
from actors.session_actor import ACCEPTED
from actors.standby import StandbySet
from torpor.ports import Reason
from torpor.settings import Placement


class Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[object, ...]] = []

    def remote(self, *args: object) -> asyncio.Future[Any]:
        self.calls.append(args)
        if isinstance(self.answer, asyncio.Future):
            return self.answer
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


class Actor:
    """A session actor (named, or a standby): answers at once, sleeps when told."""

    def __init__(self) -> None:
        self.slept: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready = Method(1234)
        self.activate = Method(ACCEPTED)
        self.adopt = Method(ACCEPTED)
        self.finished = Method(self.slept)
        self.retire = Method(True)


def activator_with_standbys(named: Actor) -> tuple[Any, StandbySet]:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: actors are fakes
    activator.namespace, activator.config = "t", object()
    activator._placements = {"s_1": Placement.DEDICATED}
    activator.admission = Admission(10, alive=set)
    activator.standby = standby = StandbySet(1, Actor)
    activator._adopted, activator._adopting, activator._watchers = {}, {}, set()
    return activator, standby


async def test_requests_while_a_named_actor_runs_go_to_it_not_to_a_standby(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session the empty standby set could not take got a named actor. Each request
    while that actor ran took a standby (refilled with a process start), which found the
    session leased and exited: a process started per request, for nothing."""
    named = Actor()
    monkeypatch.setattr(
        ray_activator,
        "SessionActor",
        SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda *_: named)),
    )
    activator, standby = activator_with_standbys(named)
    async with asyncio.timeout(5):
        await activator.request("s_1", reason=Reason.SUBMIT)  # none ready: the named path
        assert len(named.activate.calls) == 1
        await standby.filled(timeout_s=5)
        taken = list(standby._ready)
        await activator.request("s_1", reason=Reason.EVENT)
        await activator.request("s_1", reason=Reason.EVENT)
    assert len(named.activate.calls) == 3, "the running actor took them"
    assert list(standby._ready) == taken and standby.started == 1
    assert all(not h.adopt.calls for h in taken)
    named.slept.set_result(None)  # it exits: the next request needs another actor
    async with asyncio.timeout(5):
        while "s_1" in activator._adopted:
            await asyncio.sleep(0)
    await standby.close()
