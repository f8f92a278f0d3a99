"""A work's outcome delivery counts the cluster's nodes off its event loop, and only
where they decide (no Ray started: ``ray.nodes`` is replaced, at the module boundary,
by a slow one).

Each delivery makes an activator, whose storage check counts the live nodes with
``ray.nodes()``: a GCS call that blocks its thread until the GCS answers (Ray's
deadline: 60 s). Made on a watcher's loop, a slow GCS held its progress reports and
its stop there.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from actors import work_delivery
from actors.config_ref import ConfigRef
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from tests.unit.test_ray_work_runner import an_order
from torpor.errors import EmbeddedBackendOnCluster
from torpor.settings import Settings
from torpor.work import outcome_data

CLUSTER_STORAGE = {"object_store_url": "s3://bucket/p", "index_url": "redis://redis:6379/0"}


class SlowNodes:
    """``ray.nodes``: ``alive`` live nodes (and a dead one), after ``SLOW_S``."""

    def __init__(self, alive: int) -> None:
        self.alive = alive
        self.calls = 0

    def __call__(self) -> list[dict[str, Any]]:
        self.calls += 1
        time.sleep(SLOW_S)
        return [{"Alive": True}] * self.alive + [{"Alive": False}]


class Sessions:
    """The session service a delivery hands its event to: takes it at once."""

    def __init__(self, services: Any, activator: Any) -> None:
        self.activator = activator

    async def deliver(self, event: Any) -> bool:
        return True


def nodes(monkeypatch: pytest.MonkeyPatch, alive: int = 1) -> SlowNodes:
    slow = SlowNodes(alive)
    monkeypatch.setattr(ray, "nodes", slow)
    monkeypatch.setattr(work_delivery, "SessionService", Sessions)
    return slow


async def delivered(settings: Settings) -> bool:
    services = SimpleNamespace(settings=settings, clock=SimpleNamespace(now=lambda: NOW))
    outcome = outcome_data(ok=True, value=1)
    return await work_delivery.deliver(services, ConfigRef.of_loaded(settings), an_order(), outcome)


NOW = datetime(2026, 12, 1, tzinfo=UTC)


async def test_a_delivery_counts_the_clusters_nodes_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = nodes(monkeypatch)
    stall = await longest_stall(lambda: delivered(Settings()))  # embedded storage
    assert counted.calls == 1, "the nodes were not counted: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s GCS call"


async def test_a_delivery_on_storage_shared_across_hosts_asks_the_gcs_for_no_node_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The count decides only for embedded storage: for any other it was asked for, on
    the loop, and never read."""
    counted = nodes(monkeypatch)
    assert await delivered(Settings(storage=CLUSTER_STORAGE))
    assert counted.calls == 0


async def test_a_delivery_on_embedded_storage_in_a_cluster_of_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted off the loop, the check still reads the count, at every delivery."""
    nodes(monkeypatch, alive=3)
    with pytest.raises(EmbeddedBackendOnCluster):
        await delivered(Settings())
