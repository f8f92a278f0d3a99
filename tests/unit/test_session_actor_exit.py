"""A session actor's way out once its session sleeps (pure code, no Ray started: the
actor's class is driven directly, its services and Ray's context are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors import session_actor, wiring
from actors.session_actor import SessionActor


class HangingServices:
    """Services whose close never returns: an agent's or a tool's ``close`` that hangs."""

    def __init__(self) -> None:
        self.closing = False

    async def close(self) -> None:
        self.closing = True
        await asyncio.Event().wait()


async def test_an_actor_whose_services_never_close_still_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It waited on the close for ever: never exited, a process held, and its session's
    name held by an actor that answers every request ``closing`` (no new actor could
    take the session)."""
    monkeypatch.setattr(session_actor, "CLOSE_TIMEOUT_S", 0.05, raising=False)
    monkeypatch.setattr(wiring, "session_runtime", lambda services, owner: object())
    context = SimpleNamespace(get_node_id=lambda: "node0000ffff")
    monkeypatch.setattr(session_actor.ray, "get_runtime_context", lambda: context)
    cls: Any = SessionActor.__ray_actor_class__  # type: ignore[attr-defined]
    actor = cls.__new__(cls)
    services = HangingServices()
    actor._services, actor._wanted, actor._closing = services, [], False
    actor._done = asyncio.Event()
    exits: list[bool] = []
    actor._exit = lambda: exits.append(True)
    async with asyncio.timeout(5):
        await actor._run("s_1")
    assert services.closing and actor._done.is_set() and exits == [True]
