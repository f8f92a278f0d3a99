"""The reconciler's loops outlive services that do not open at first (no Ray started:
the actor's class is driven directly, on the test's loop, with real Redis and a local
store; only what it would ask Ray's control plane is faked: the count of its nodes, and
the standbys a predecessor left, none)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from actors import ray_activator
from actors.reconciler import Reconciler
from tests.conftest import eventually
from tests.support.harness import settings_for
from torpor.settings import Settings

SECRET_ENV = "TORPOR_TEST_RECONCILER_AUDIT_KEY"


def bare_reconciler(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Any:
    """A reconciler as its constructor leaves it, before its call to its own ``start``
    (made by the constructor itself, so a field it gains is never missing here)."""
    itself = SimpleNamespace(start=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(current_actor=itself))
    cls: Any = Reconciler.__ray_actor_class__  # type: ignore[attr-defined]
    # A stand-in for the ConfigRef: the test's settings hold a secret inline, which a
    # real one refuses to carry (as Ray would store it with the arguments).
    return cls(SimpleNamespace(load=lambda: settings))


async def test_a_reconciler_whose_services_did_not_open_at_first_sweeps_once_they_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """``start`` opened the services before it started the loops: an open that failed
    (here the audit key's environment variable, not set on the node Ray restarted it
    on) raised out of the one ``start`` a restart makes, and the reconciler never swept
    again. The loops start, count the failed open as a failed sweep, and sweep once the
    services open."""
    monkeypatch.setattr(ray_activator, "alive_nodes", lambda: 1)

    async def none_left(holder: str, namespace: str) -> list[Any]:
        return []

    monkeypatch.setattr(ray_activator, "left_by", none_left)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    extra = {"security": {"audit_key": f"env:{SECRET_ENV}"}, "reconciler": {"interval_s": 0.01}}
    actor = bare_reconciler(
        monkeypatch, settings_for(tmp_path, redis_url, redis_prefix, extra=extra)
    )
    try:
        assert await actor.start() is True
        await eventually(lambda: actor._failures >= 1, what="a sweep whose open failed")
        monkeypatch.setenv(SECRET_ENV, "a" * 32)
        await eventually(lambda: actor._sweeps >= 1, what="a sweep once the services open")
    finally:
        await stopped([t for t in (actor._loop, actor._deadline_loop) if t is not None])
        if actor._activator is not None:
            await actor._activator.close()
        if actor._services is not None:
            await actor._services.close()


async def stopped(loops: list[asyncio.Task[None]]) -> None:
    """The loops cancelled until they end. One cancel was not always enough: in one CI run
    under load the sweep loop took it inside a sweep that then completed (a call on the
    sweep's path let the cancel go, on Python 3.11), and swept on, "cancelling", until the
    test's timeout (300 s). Bounded: a loop still running after 30 cancels fails the test."""
    for _ in range(30):
        if all(t.done() for t in loops):
            return
        for t in loops:
            t.cancel()
        await asyncio.wait(loops, timeout=1.0)
    pytest.fail(f"a reconciler loop did not stop after 30 cancels: {loops}")
