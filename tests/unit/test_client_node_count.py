"""An asyncio client connects with its GCS calls off its caller's event loop (no Ray
started: ``ray.nodes`` and the reconciler's start are replaced, at the module boundary,
by slow ones, and the services and what the client builds on them are stand-ins).

The services open in a thread too: ``open_services`` blocks (files, sockets, the
descriptor table's growth).

The client's activator counts the live nodes for embedded storage's check
(``ray.nodes()``), and the client makes sure the reconciler runs (a GCS call, then up
to a process start's time): each blocks its thread. ``AsyncClient(...)`` is a
constructor and makes them in its caller's thread; ``AsyncClient.connect`` makes them
off the loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import ray

from actors import reconciler, wiring
from tests.conftest import eventually
from tests.unit.test_delivery_node_count import CLUSTER_STORAGE, SlowNodes
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from torpor.client import AsyncClient, Client
from torpor.errors import EmbeddedBackendOnCluster, InvalidRequest
from torpor.service import batches, sessions
from torpor.settings import Settings


class StandIn:
    """Whatever the client builds on its services: takes its arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class Connection:
    """What a client connecting here met: the node count, its reconciler's starts, and
    the services it opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, alive: int, open_s: float) -> None:
        self.nodes = SlowNodes(alive)
        self.started: list[Any] = []
        self.services: list[Services] = []
        self.open_s = open_s
        self.opening = threading.Event()
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "nodes", self.nodes)
        monkeypatch.setattr(reconciler, "ensure_reconciler", self.start)
        monkeypatch.setattr(wiring, "open_services", self.open)
        monkeypatch.setattr(sessions, "SessionService", StandIn)
        monkeypatch.setattr(batches, "BatchService", StandIn)

    def start(self, config: Any) -> None:
        self.started.append(config)
        time.sleep(SLOW_S)

    def open(self, settings: Settings) -> Services:
        self.opening.set()
        time.sleep(self.open_s)
        self.services.append(Services(settings))
        return self.services[-1]


def connection(monkeypatch: pytest.MonkeyPatch, alive: int = 1, open_s: float = 0) -> Connection:
    return Connection(monkeypatch, alive, open_s)


async def test_an_asyncio_client_connects_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    met = connection(monkeypatch)
    made: list[AsyncClient] = []

    async def connect() -> None:
        made.append(await AsyncClient.connect(Settings()))  # embedded storage

    stall = await longest_stall(connect)
    assert made, "no client was made"
    assert met.nodes.calls == 1, "the nodes were not counted: this measured nothing"
    assert len(met.started) == 1, "the reconciler was not started: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by {SLOW_S} s GCS calls"


async def test_a_client_on_embedded_storage_in_a_cluster_of_several_nodes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted off the loop, the check still reads the count; the services opened for
    the client are closed, and no reconciler is started for it."""
    met = connection(monkeypatch, alive=3)
    with pytest.raises(EmbeddedBackendOnCluster):
        await AsyncClient.connect(Settings())
    assert [s.closed for s in met.services] == [True]
    assert met.started == []


async def test_a_client_on_shared_storage_asks_the_gcs_for_no_node_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    met = connection(monkeypatch)
    await AsyncClient.connect(Settings(storage=CLUSTER_STORAGE), start_reconciler=False)
    assert met.nodes.calls == 0
    assert met.started == []


async def test_an_asyncio_client_opens_its_services_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    met = connection(monkeypatch, open_s=SLOW_S)

    async def connect() -> None:
        await AsyncClient.connect(Settings(storage=CLUSTER_STORAGE), start_reconciler=False)

    stall = await longest_stall(connect)
    assert len(met.services) == 1, "no services were opened: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s open"


async def test_services_opened_for_a_connect_cancelled_meanwhile_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    met = connection(monkeypatch, open_s=0.3)
    connecting = asyncio.create_task(
        AsyncClient.connect(Settings(storage=CLUSTER_STORAGE), start_reconciler=False)
    )
    await eventually(met.opening.is_set, timeout_s=5, interval_s=0.01, what="the open began")
    connecting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await connecting
    await eventually(
        lambda: met.services and met.services[0].closed,
        timeout_s=5,
        interval_s=0.01,
        what="the services opened meanwhile are closed",
    )


def test_a_client_given_an_unknown_argument_refuses_it_before_it_starts_ray(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The blocking client starts Ray in its caller's thread before its loop's work: an
    argument ``AsyncClient.connect`` does not take is refused first, not after a local
    Ray was started for nothing."""
    started: list[object] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.append(kwargs))
    with pytest.raises(TypeError):
        Client(Settings(), tennant="acme")  # misspelt
    assert started == []


@pytest.mark.parametrize("tenant", ["", "acme corp", "a/b", "..", "a" * 129])
async def test_a_client_for_a_tenant_no_api_tenant_could_be_is_refused_before_it_starts_ray(
    monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    """A client's tenant is named as the API's tenants are (``Settings.tenants``): the
    tenant names objects in storage (every keyed submit of one outside that alphabet was
    refused), and "" is the session registry's "tenant not known" (a session whose
    snapshot's header did not read), whose listings such a client shared. Each of the
    three ways to make a client refuses it with a typed error, before Ray starts."""
    started: list[object] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: started.append(kwargs))
    with pytest.raises(InvalidRequest, match="tenant"):
        Client(Settings(), tenant=tenant)
    with pytest.raises(InvalidRequest, match="tenant"):
        AsyncClient(Settings(), tenant=tenant)
    with pytest.raises(InvalidRequest, match="tenant"):
        await AsyncClient.connect(Settings(), tenant=tenant)
    assert started == []
