"""``/healthz``: the index and the object store answer, and the reconciler swept recently."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.wiring import open_services
from storage.local_store import LocalObjectStore
from storage.redis_index import RedisIndex
from torpor.clock import ManualClock
from torpor.errors import StorageUnavailable
from torpor.ports.services import Services
from torpor.service.health import STALE_AFTER_INTERVALS, health_answer
from torpor.settings import Settings

RECONCILER = object()  # the app runs one (its handle)


@pytest.fixture
async def services(tmp_path: Path) -> AsyncIterator[Services]:
    settings = Settings.build(
        {"storage": {"object_store_url": "memory://", "index_url": "memory://"}}
    )
    services = open_services(settings, clock=ManualClock())
    yield services
    await services.close()


async def answer(services: Services, reconciler: object | None = RECONCILER) -> dict[str, Any]:
    return await health_answer(services, reconciler, "9.9")


async def test_healthy_once_a_sweep_completed(services: Services) -> None:
    await services.index.record_sweep(at=services.clock.now())
    got = await answer(services)
    assert got["status_code"] == 200 and got["content"]["ok"] is True
    assert got["content"]["version"] == "9.9" and got["content"]["last_sweep_age_s"] == 0


async def test_the_edge_says_which_way_its_webhooks_went(services: Services) -> None:
    """What the replica's webhook route reports (``HookRoute.report``) is passed on as is:
    an operator can see whether Serve put torpor's middleware in the replica's server."""
    report = {"webhooks_before_serve": True, "route_prefix": "/"}
    got = await health_answer(services, None, "9.9", ingress=report)
    assert got["status_code"] == 200 and got["content"]["ingress"] == report
    assert "ingress" not in (await answer(services, reconciler=None))["content"]


async def test_no_sweep_yet_is_unhealthy_where_a_reconciler_runs(services: Services) -> None:
    got = await answer(services)
    assert got["status_code"] == 503 and got["media_type"] == "application/problem+json"
    assert "reconciler" in got["content"]["detail"]
    assert (await answer(services, reconciler=None))["status_code"] == 200


async def test_a_stale_sweep_is_unhealthy(services: Services) -> None:
    clock = services.clock
    assert isinstance(clock, ManualClock)
    await services.index.record_sweep(at=clock.now())
    interval = services.settings.reconciler.interval_s
    clock.advance(STALE_AFTER_INTERVALS * interval - 1)
    assert (await answer(services))["status_code"] == 200
    clock.advance(2)
    got = await answer(services)
    assert got["status_code"] == 503 and "last complete sweep" in got["content"]["detail"]
    assert got["headers"]["Retry-After"]


async def test_an_unreachable_index_is_unhealthy(services: Services) -> None:
    services.index = RedisIndex("redis://127.0.0.1:1/0")  # nothing listens there
    got = await answer(services, reconciler=None)
    assert got["status_code"] == 503 and "index" in got["content"]["detail"]


async def test_an_unreachable_object_store_is_unhealthy(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def down(*_: object, **__: object) -> object:
        raise StorageUnavailable("the store is down")

    monkeypatch.setattr(services.store, "list", down)
    got = await answer(services, reconciler=None)
    assert got["status_code"] == 503 and "object store" in got["content"]["detail"]


async def test_a_local_store_whose_log_no_longer_checkpoints_is_reported_not_unhealthy(
    tmp_path: Path,
) -> None:
    """Its logs grow until a reboot: the answer says why, but stays 200 (the replica
    serves, and neither a restart nor taking it out of service cures a failed flush)."""
    settings = Settings.build(
        {"storage": {"object_store_url": f"file://{tmp_path}", "index_url": "memory://"}}
    )
    services = open_services(settings, clock=ManualClock())
    try:
        store = services.store
        assert isinstance(store, LocalObjectStore)
        store._log.not_checkpointing = "a flush of the file system failed (EIO)"
        got = await answer(services, reconciler=None)
        assert got["status_code"] == 200
        (warning,) = got["content"]["warnings"]
        assert "not checkpointing" in warning and "EIO" in warning
    finally:
        await services.close()
