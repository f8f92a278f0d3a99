"""The reconciler counts the cluster's nodes off its event loop (no Ray started: its
actor's class runs in this process, ``ray.nodes`` is replaced, at the module boundary,
by a slow one, and the session service and sweeper it builds are stand-ins).

Each incarnation makes its activator once, whose storage check counts the live nodes
(embedded storage only) with ``ray.nodes()``: a GCS call that blocks its thread until
the GCS answers (Ray's deadline: 60 s). Made on the reconciler's loop, a slow GCS held
its deadline loop and its ``status`` there.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from actors import reconciler
from actors.config_ref import ConfigRef
from tests.unit.test_delivery_node_count import CLUSTER_STORAGE, SlowNodes
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from torpor.errors import EmbeddedBackendOnCluster
from torpor.settings import Settings


class Sweeper:
    def __init__(self, control: Any) -> None:
        self.control = control


def a_reconciler(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> Any:
    """The reconciler's class, made here with ``settings`` and services already open."""
    itself = SimpleNamespace(start=SimpleNamespace(remote=lambda: None))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(current_actor=itself))
    # The standbys its predecessor left are listed (off the loop too): none.
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces=False: [])
    monkeypatch.setattr(reconciler, "SessionService", lambda services, activator, **_: activator)
    monkeypatch.setattr(reconciler, "Sweeper", Sweeper)
    cls = reconciler.Reconciler.__ray_metadata__.modified_class  # type: ignore[attr-defined]
    made = cls(ConfigRef.of_loaded(settings))
    made._services = SimpleNamespace(settings=settings)
    return made


def nodes(monkeypatch: pytest.MonkeyPatch, alive: int = 1) -> SlowNodes:
    slow = SlowNodes(alive)
    monkeypatch.setattr(ray, "nodes", slow)
    return slow


async def ensured(made: Any) -> Any:
    sweeper = await made._ensure()
    if made._activator._predecessor is not None:  # its listing, done before the test ends
        await made._activator._predecessor
    return sweeper


async def test_the_reconciler_counts_the_clusters_nodes_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = nodes(monkeypatch)
    made = a_reconciler(monkeypatch, Settings())  # embedded storage
    stall = await longest_stall(lambda: ensured(made))
    assert counted.calls == 1, "the nodes were not counted: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s GCS call"
    assert made._sweeper is not None


async def test_the_reconciler_on_embedded_storage_in_a_cluster_of_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted off the loop, the check still reads the count."""
    nodes(monkeypatch, alive=3)
    made = a_reconciler(monkeypatch, Settings())
    with pytest.raises(EmbeddedBackendOnCluster):
        await made._ensure()
    assert made._sweeper is None  # the next sweep checks again


async def test_the_reconciler_on_shared_storage_asks_the_gcs_for_no_node_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = nodes(monkeypatch)
    made = a_reconciler(monkeypatch, Settings(storage=CLUSTER_STORAGE))
    await ensured(made)
    assert counted.calls == 0


async def test_the_sweep_and_deadline_loops_asking_at_once_make_one_activator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the loop, the count leaves room for the other loop's ``_ensure``: without its
    lock each would make an activator of its own (and retire or start standbys twice)."""
    counted = nodes(monkeypatch)
    made = a_reconciler(monkeypatch, Settings())
    first, second = await asyncio.gather(ensured(made), ensured(made))
    assert first is second
    assert counted.calls == 1
