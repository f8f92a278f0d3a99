"""A Serve replica's ingress counts the cluster's nodes off its event loop (no Ray or
Serve started: the deployment's own class is made here, ``ray.nodes`` is replaced, at
the module boundary, by a slow one, and what the ingress builds around its activator
is stand-ins).

The ingress makes its activator in its async constructor, whose storage check counts
the live nodes (embedded storage only) with ``ray.nodes()``: a GCS call that blocks its
thread until the GCS answers (Ray's deadline: 60 s), and the replica's loop with it."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

import serve_app
from actors import named
from actors.config_ref import ConfigRef
from actors.ray_activator import RayActivator
from tests.conftest import eventually
from tests.unit.test_delivery_node_count import CLUSTER_STORAGE, SlowNodes
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from torpor.errors import ClusterUnavailable, EmbeddedBackendOnCluster
from torpor.settings import Settings


class StandIn:
    """Whatever the ingress builds around its activator: takes its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args


async def nothing(*args: Any) -> None:
    return None


class Services:
    """The ingress's services: what it reads of them, and whether they were closed."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.clock = self.audit = None
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def ingress_class() -> Any:
    """The deployment's own class (not Serve's wrapper). Serve keeps a copy of it, made
    when ``serve_app`` was imported, with globals of its own: what it is to find is set
    there, not on the module."""
    return serve_app.Ingress.func_or_class.__mro__[1]  # type: ignore[attr-defined]


def counted(
    monkeypatch: pytest.MonkeyPatch,
    alive: int = 1,
    opened: list[Services] | None = None,
    open_s: float = 0.0,
    opening: threading.Event | None = None,
    release: threading.Event | None = None,
) -> SlowNodes:
    """``ray.nodes`` answers after ``SLOW_S``; the ingress's services (each added to
    ``opened``, after ``open_s`` in the opener's thread) and what it builds on them are
    stand-ins."""
    slow = SlowNodes(alive)
    monkeypatch.setattr(ray, "nodes", slow)
    found = ingress_class().__init__.__globals__
    assert found["RayActivator"] is RayActivator, "the ingress makes no RayActivator"
    opened = [] if opened is None else opened

    def open_services(settings: Settings, observer: Any) -> Services:
        if opening is not None:
            opening.set()
        time.sleep(open_s)  # blocking, as files, sockets and the store's reads are
        if release is not None:
            assert release.wait(timeout=30), "never released"
        opened.append(Services(settings))
        return opened[-1]

    stand_ins: dict[str, Any] = {
        "open_services": open_services,
        "RayObserver": lambda: None,
        "SessionService": StandIn,
        "BatchService": StandIn,
        "WebhookGateway": StandIn,
        "SessionStreams": StandIn,
        "DeliveryWorker": StandIn,
        "hooks": SimpleNamespace(ROUTE=SimpleNamespace(bind=lambda *a, **k: None)),
        "CONSOLE": SimpleNamespace(bind=lambda deps: None),
        "warm_services": nothing,
        "settle_heap": lambda: None,
    }
    for name, stand_in in stand_ins.items():
        assert name in found, f"the ingress no longer uses {name}: revise this test"
        monkeypatch.setitem(found, name, stand_in)
    return slow


async def an_ingress(settings: Settings) -> Any:
    """The deployment's own class, made as Serve makes it."""
    ingress = ingress_class()

    class Made(ingress):  # type: ignore[misc,valid-type]
        def __del__(self) -> None:
            """Serve's shutdown (async) is not this test's: never left unawaited."""

    made = Made.__new__(Made)
    await ingress.__init__(made, ConfigRef.of_loaded(settings))
    return made


async def test_the_ingress_counts_the_clusters_nodes_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = counted(monkeypatch)
    made: list[Any] = []

    async def ingress() -> None:
        made.append(await an_ingress(Settings()))  # embedded storage

    stall = await longest_stall(ingress)
    assert slow.calls == 1, "the nodes were not counted: this measured nothing"
    assert made, "the ingress was not made"
    assert isinstance(made[0].services, Services), "the ingress opened real services"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s GCS call"


async def test_the_ingress_on_embedded_storage_in_a_cluster_of_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted off the loop, the check still reads the count; the services opened for
    the ingress are closed."""
    opened: list[Services] = []
    counted(monkeypatch, alive=3, opened=opened)
    with pytest.raises(EmbeddedBackendOnCluster):
        await an_ingress(Settings())
    assert [s.closed for s in opened] == [True]


async def test_the_ingress_closes_its_services_when_the_gcs_does_not_answer_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened: list[Services] = []
    counted(monkeypatch, opened=opened)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.1)  # ``ray.nodes`` takes ``SLOW_S``
    with pytest.raises(ClusterUnavailable):
        await an_ingress(Settings())  # embedded storage: its nodes are counted
    assert [s.closed for s in opened] == [True]


async def test_the_ingress_on_shared_storage_asks_the_gcs_for_no_node_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = counted(monkeypatch)
    await an_ingress(Settings(storage=CLUSTER_STORAGE))
    assert slow.calls == 0


async def test_an_ingress_that_fails_to_warm_up_frees_what_it_started_and_binds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve makes a replica whose constructor failed again: the standbys the failed one
    started (detached processes) and its services stayed for their idle time or the
    process's life, and the webhook route was left bound to a gateway on closed services."""
    opened: list[Services] = []
    counted(monkeypatch, opened=opened)
    found = ingress_class().__init__.__globals__
    bound: list[str] = []
    monkeypatch.setitem(
        found,
        "hooks",
        SimpleNamespace(ROUTE=SimpleNamespace(bind=lambda *a, **k: bound.append("route"))),
    )
    monkeypatch.setitem(
        found, "CONSOLE", SimpleNamespace(bind=lambda deps: bound.append("console"))
    )

    async def cancelled(services: Any) -> None:
        raise asyncio.CancelledError()  # Serve stopping the replica while it starts

    monkeypatch.setitem(found, "warm_services", cancelled)
    closed: list[RayActivator] = []

    async def close(self: RayActivator) -> None:
        closed.append(self)

    monkeypatch.setattr(RayActivator, "close", close)
    with pytest.raises(asyncio.CancelledError):
        await an_ingress(Settings())
    assert [s.closed for s in opened] == [True], "the services were left open"
    assert len(closed) == 1, "the activator (its standbys) was not closed"
    assert bound == [], f"bound to a replica that did not start: {bound}"


async def test_the_ingress_opens_its_services_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``open_services`` blocks (files, sockets, the store's first reads): made on the
    replica's loop, it held every other coroutine there, Serve's own calls included, for
    as long. Shared storage: no node count beside it."""
    opened: list[Services] = []
    counted(monkeypatch, opened=opened, open_s=SLOW_S)
    made: list[Any] = []

    async def ingress() -> None:
        made.append(await an_ingress(Settings(storage=CLUSTER_STORAGE)))

    stall = await longest_stall(ingress)
    assert made and made[0].services is opened[0], "the ingress was not made on them"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s open"


async def test_an_ingress_cancelled_while_its_services_open_closes_them_once_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve stopping a replica while it starts: the thread opening the services cannot
    be stopped, and what it opened is closed once it is done, not left open for the
    process's life."""
    opened: list[Services] = []
    opening, release = threading.Event(), threading.Event()
    counted(monkeypatch, opened=opened, opening=opening, release=release)
    starting = asyncio.ensure_future(an_ingress(Settings(storage=CLUSTER_STORAGE)))
    await eventually(opening.is_set, timeout_s=10)  # the opener's thread has begun
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not opened, "opened before the cancel: it tested nothing"
    release.set()  # the thread finishes opening after its caller is gone
    await eventually(lambda: [s.closed for s in opened] == [True], timeout_s=10)
