"""A pool host's listener outlives a failed start (no Ray started: the host's class is
driven directly, on the test's loop, with real Redis and a local store; only Ray's
context is faked)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from actors import pool
from actors.pool import PoolHost, pool_channel
from tests.conftest import eventually
from tests.support.actor_globals import patch_global
from tests.support.harness import settings_for
from torpor.ports import Reason, Wanted
from torpor.settings import Settings

SECRET_ENV = "TORPOR_TEST_POOL_AUDIT_KEY"


def bare_host(settings: Settings) -> Any:
    """A pool host as its constructor leaves it, its listener not started yet."""
    cls: Any = PoolHost.__ray_actor_class__  # type: ignore[attr-defined]
    host = cls.__new__(cls)
    host._settings, host._slot = settings, 0
    host._services, host._runtime = None, None
    host._wanted, host._tasks = {}, {}
    host._gate = asyncio.Semaphore(settings.pool.max_concurrency)
    host.activations = 0
    return host


async def test_a_pool_host_whose_services_did_not_open_at_first_takes_its_channel_once_they_do(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
) -> None:
    """The listener opened the host's services before its loop: an open that failed
    (here the audit key's environment variable, not set yet on the node) ended it, and
    the host took nothing from its channel until an activator found it stalled,
    ``STALLED_CHANNEL`` requests later. It opens them again until they open."""
    cls = PoolHost.__ray_actor_class__  # type: ignore[attr-defined]
    patch_global(monkeypatch, cls, pool, "LISTEN_BACKOFF", SimpleNamespace(delay_s=lambda _: 0.01))
    context = SimpleNamespace(get_node_id=lambda: "node0000ffff")
    monkeypatch.setattr(pool.ray, "get_runtime_context", lambda: context)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    settings = settings_for(
        tmp_path, redis_url, redis_prefix, extra={"security": {"audit_key": f"env:{SECRET_ENV}"}}
    )
    host = bare_host(settings)
    listener = asyncio.create_task(host._listen())
    try:
        await eventually(
            lambda: listener.done() or "cannot open its services" in caplog.text,
            what="an open that failed",
        )
        monkeypatch.setenv(SECRET_ENV, "a" * 32)
        await eventually(lambda: host._services is not None, what="services opened")
        queue = host._services.activations
        wanted = Wanted("s_missing", Reason.EVENT, time.time())
        await queue.push(pool_channel(settings.namespace, 0), wanted)
        await eventually(lambda: host.activations == 1, what="the request taken and run")
    finally:
        listener.cancel()
        await asyncio.gather(listener, *host._tasks.values(), return_exceptions=True)
        if host._services is not None:
            await host._services.close()
