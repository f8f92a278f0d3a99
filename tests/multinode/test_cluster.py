"""A head and two worker nodes in one machine (ray.cluster_utils.Cluster), real Redis and
the S3 test server: sessions spread over nodes, a worker node is removed while some
sessions run and others wait, and every session still completes, none twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.ray_activator import RayActivator
from actors.wiring import open_services
from tests.conftest import eventually
from tests.ray.conftest import ray_settings
from tests.support.harness import Env
from tests.support.s3_server import S3TestServer
from tests.support.tools import World
from torpor.clock import SystemClock
from torpor.errors import EmbeddedBackendOnCluster
from torpor.lifecycle import SessionState
from torpor.ports.services import Services
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
S = SessionState


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(
        address=c.address,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    c.workers = workers  # type: ignore[attr-defined]
    yield c
    ray.shutdown()
    c.shutdown()


async def test_embedded_storage_is_refused_on_a_cluster(cluster: Cluster, tmp_path: Path) -> None:
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": f"file://{tmp_path}/o",
                "index_url": f"sqlite://{tmp_path}/i.db",
            }
        }
    )
    services = open_services(settings)
    with pytest.raises(EmbeddedBackendOnCluster, match="3 nodes"):
        RayActivator(services)
    await services.close()


async def test_sessions_survive_losing_a_worker_node(
    cluster: Cluster, s3_server: S3TestServer, redis_url: str, redis_prefix: str
) -> None:
    settings = ray_settings(s3_server, redis_url, redis_prefix, hold="go")
    services = open_services(settings, clock=SystemClock())
    control = SessionService(services, RayActivator(services))
    world = World(redis_url, redis_prefix)
    env = Env(services, control, world, SystemClock())  # type: ignore[arg-type]
    sweeper = Sweeper(control)
    try:
        # A first wave gets past the held tool and waits for approval …
        waiting = [await env.submit(doc=f"W-{i}") for i in range(6)]
        await world.open_gate("go")

        async def all_waiting() -> bool:
            dispatched = await world.entries("dispatch")
            return all(f"acme:approve:W-{i}:1" in dispatched for i in range(6))

        await eventually(all_waiting, timeout_s=90, what="the first wave waits")
        # … while a second wave is held mid-run, inside its sync tool, on every node.
        await world.close_gate("go")
        running = [await env.submit(doc=f"R-{i}") for i in range(6)]

        async def all_held() -> bool:
            held = await world.entries("held")
            return all(f"R-{i}" in held for i in range(6))

        await eventually(all_held, timeout_s=90, what="the second wave is running")
        nodes = {e["node"] for e in (await world.entries("extract")).values()}
        assert len(nodes) >= 2, f"sessions ran on {len(nodes)} node(s)"

        victim = cluster.workers[0]  # type: ignore[attr-defined]
        cluster.remove_node(victim)
        await world.open_gate("go")

        async def recovered() -> bool:
            await sweeper.sweep_once()
            await control.drain()
            states = await services.index.session_states(running)
            return all(states.get(sid) is S.SUSPENDED for sid in running)

        try:
            await eventually(recovered, timeout_s=120, interval_s=0.5, what="wave recovered")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await where_they_are(services, running)}") from None
        for sid in [*waiting, *running]:
            await env.answer(sid, {"status": "approved"})

        async def all_done() -> bool:
            await sweeper.sweep_once()
            await control.drain()
            states = await services.index.session_states([*waiting, *running])
            return all(s is S.COMPLETED for s in states.values()) and len(states) == 12

        everyone = [*waiting, *running]
        try:
            await eventually(all_done, timeout_s=120, interval_s=0.5, what="all completed")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{await where_they_are(services, everyone)}") from None
        dispatches = await world.counts("dispatch")
        assert len(dispatches) == 12 and set(dispatches.values()) == {1}, dispatches
        effects = await world.entries("extract")
        assert len(effects) == 12, "each session's extraction took effect exactly once"
        for sid in [*waiting, *running]:
            snap = await services.snapshots.load(sid)
            assert snap.result == {"decision": "approved", "doc": snap.input["doc"]}  # type: ignore[index]
    finally:
        await world.close()
        await services.close()


async def where_they_are(services: Services, session_ids: list[str]) -> str:
    """What a failed wait saw, per session: index state, snapshot state and generation,
    the last transitions, open waits and unprocessed inbox events (the failure this
    test once had left no trace of which session stalled, or where)."""
    states = await services.index.session_states(session_ids)
    lines = []
    for sid in session_ids:
        try:
            snap = await services.snapshots.load(sid)
        except Exception as exc:
            lines.append(f"{sid}: index {states.get(sid)}, snapshot unreadable ({exc!r})")
            continue
        pending = await services.inbox.pending(sid, processed=set(snap.processed_events))
        history = " > ".join(f"{h.state.value}({h.reason})" for h in snap.history[-5:])
        lines.append(
            f"{sid}: index {states.get(sid)}, snapshot {snap.state.value} gen "
            f"{snap.generation}, waits {[w.correlation_id for w in snap.waits]}, "
            f"unprocessed {[e.key for e in pending]}, history {history}"
        )
    return "\n".join(lines)
