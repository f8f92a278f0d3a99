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

from actors import ray_activator
from actors.reconciler import Reconciler
from tests.conftest import eventually
from tests.support.harness import settings_for
from torpor.settings import Settings

SECRET_ENV = "TORPOR_TEST_RECONCILER_AUDIT_KEY"


def bare_reconciler(settings: Settings) -> Any:
    """A reconciler as its constructor leaves it, before its call to its own ``start``."""
    cls: Any = Reconciler.__ray_actor_class__  # type: ignore[attr-defined]
    actor = cls.__new__(cls)
    actor._config = SimpleNamespace(load=lambda: settings)
    actor._settings = settings
    actor._services = actor._sweeper = actor._activator = None
    actor._loop = actor._deadline_loop = None
    actor._sweeps = actor._failures = 0
    actor._last, actor._step_errors = {}, {}
    actor._ensuring = asyncio.Lock()
    return actor


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
    actor = bare_reconciler(settings_for(tmp_path, redis_url, redis_prefix, extra=extra))
    try:
        assert await actor.start() is True
        await eventually(lambda: actor._failures >= 1, what="a sweep whose open failed")
        monkeypatch.setenv(SECRET_ENV, "a" * 32)
        await eventually(lambda: actor._sweeps >= 1, what="a sweep once the services open")
    finally:
        for loop in (actor._loop, actor._deadline_loop):
            if loop is not None:
                loop.cancel()
        await asyncio.gather(
            *(t for t in (actor._loop, actor._deadline_loop) if t), return_exceptions=True
        )
        if actor._activator is not None:
            await actor._activator.close()
        if actor._services is not None:
            await actor._services.close()
