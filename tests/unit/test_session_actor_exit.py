"""A session actor's way out once its session sleeps (pure code, no Ray started: the
actor's class is driven directly, its services and Ray's context are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors import session_actor, wiring
from actors.session_actor import CLOSING, SessionActor
from tests.support.actor_globals import patch_global


class HangingServices:
    """Services whose close never returns: an agent's or a tool's ``close`` that hangs."""

    def __init__(self) -> None:
        self.closing = False

    async def close(self) -> None:
        self.closing = True
        await asyncio.Event().wait()


def bare_actor(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A session actor as ``__init__`` leaves a named one (its services not open yet),
    with Ray's context and the exit faked."""
    monkeypatch.setattr(wiring, "session_runtime", lambda services, owner: object())
    context = SimpleNamespace(get_node_id=lambda: "node0000ffff")
    monkeypatch.setattr(session_actor.ray, "get_runtime_context", lambda: context)
    cls: Any = SessionActor.__ray_actor_class__  # type: ignore[attr-defined]
    actor = cls.__new__(cls)
    actor._session_id, actor._services, actor._wanted = "s_1", None, []
    actor._closing, actor._task, actor._done = False, None, asyncio.Event()
    actor.exits = []
    actor._exit = lambda: actor.exits.append(True)
    return actor


async def test_a_named_actor_whose_services_cannot_open_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its task died with the open, and the actor stayed under the session's name for
    ever, answering every request "accepted" and running none (no new actor could be
    made for the session). It exits, and the next request finds a fresh one."""
    actor = bare_actor(monkeypatch)

    def cannot_open() -> Any:
        raise RuntimeError("env:TORPOR_S3_SECRET is not set")

    actor._open = cannot_open
    assert await actor.activate("event") == "accepted"
    async with asyncio.timeout(5):
        await actor._task
    assert actor.exits == [True] and actor._done.is_set()
    assert await actor.activate("event") == CLOSING


async def test_an_actor_whose_services_never_close_still_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It waited on the close for ever: never exited, a process held, and its session's
    name held by an actor that answers every request ``closing`` (no new actor could
    take the session)."""
    cls = SessionActor.__ray_actor_class__  # type: ignore[attr-defined]
    patch_global(monkeypatch, cls, session_actor, "CLOSE_TIMEOUT_S", 0.05)
    actor = bare_actor(monkeypatch)
    actor._services = services = HangingServices()
    async with asyncio.timeout(5):
        await actor._run("s_1")
    assert services.closing and actor._done.is_set() and actor.exits == [True]
