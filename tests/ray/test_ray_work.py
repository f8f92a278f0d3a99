"""Ray work as a long-running tool, on a real local Ray cluster with a fake GPU node.

A head node without the custom resource and one worker node with ``fake_gpu``: the OCR
tool's task can only run there. Real Redis counts every run by its idempotency key; the
S3 test server holds the sessions, the work records and the progress.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
import redis.asyncio as aioredis
from ray.cluster_utils import Cluster

from actors.ray_activator import RayActivator
from actors.ray_work import watcher_name
from actors.wiring import open_services
from storage.listing import all_keys
from storage.work import WorkRecords
from tests.conftest import eventually, make_bucket
from tests.ray.conftest import session_actors
from tests.support.fault_proxy import FaultProxy, path_contains
from tests.support.s3_server import S3TestServer
from tests.support.work_tools import MODEL_NAMESPACE, OcrModel, work_agents
from torpor.clock import SystemClock
from torpor.ids import business_idempotency_key, event_key
from torpor.lifecycle import SessionState
from torpor.ports.services import Services
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings
from torpor.work import WORK_SOURCE, work_id

ROOT = Path(__file__).resolve().parents[2]
S = SessionState


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.gpu_node = c.add_node(num_cpus=1, resources={"fake_gpu": 1})  # type: ignore[attr-defined]
    c.wait_for_nodes()
    ray.init(
        address=c.address,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    yield c
    ray.shutdown()
    c.shutdown()


class Rig:
    def __init__(self, services: Services, control: SessionService, r: Any, prefix: str) -> None:
        self.services, self.control, self.r, self.prefix = services, control, r, prefix
        self.sweeper = Sweeper(control)
        self.namespace = services.settings.namespace

    async def submit(self, agent: str = "scan", **input: Any) -> str:
        body = {"doc": "D-1", "hold": False, "fail": False, "size": 0, "odd": False, **input}
        body |= {"redis": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")}
        body |= {"prefix": self.prefix}
        return (await self.control.submit(tenant="acme", agent=agent, input=body)).session_id

    async def counts(self, what: str) -> dict[str, int]:
        raw = await self.r.hgetall(f"{self.prefix}{what}")
        return {k: int(v) for k, v in raw.items()}

    async def where(self) -> dict[str, dict[str, Any]]:
        raw = await self.r.hgetall(f"{self.prefix}work:where")
        return {k: json.loads(v) for k, v in raw.items()}

    async def state(self, session_id: str) -> SessionState:
        return (await self.services.snapshots.load(session_id)).state

    async def finished(self, session_id: str) -> bool:
        await self.sweeper.sweep_once()
        await self.control.drain()
        return (await self.state(session_id)).terminal

    async def key_of(self, session_id: str) -> str:
        snap = await self.services.snapshots.load(session_id)
        wait = snap.waits[0]
        return business_idempotency_key(snap.tenant, wait.action_key, wait.epoch)


@asynccontextmanager
async def opened_rig(
    s3_server: S3TestServer, redis_url: str, redis_prefix: str, *, endpoint: str | None = None
) -> AsyncIterator[Rig]:
    """A rig on a bucket of its own, reached at ``endpoint`` (a proxy) or directly."""
    bucket = "work-" + os.urandom(4).hex()
    make_bucket(s3_server, bucket)
    kw = s3_server.boto_kwargs()
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": f"s3://{bucket}/t",
                "s3": {
                    "endpoint_url": endpoint or kw["endpoint_url"],
                    "region": kw["region"],
                    "access_key_id": kw["access_key_id"],
                    "secret_access_key": kw["secret_access_key"],
                },
                "index_url": redis_url,
                "redis_prefix": redis_prefix,
            },
            "namespace": "w" + os.urandom(4).hex(),
            "agents": work_agents(),
            "security": {"inline_secrets_in_ray": True},
            "lease": {"heartbeat_s": 0.5, "ttl_s": 2.0},
            "runtime": {"retry_backoff_base_s": 0.2, "retry_backoff_cap_s": 0.5},
            "reconciler": {
                "wake_grace_s": 2.0,
                "poll_backoff_base_s": 0.5,
                "poll_backoff_cap_s": 1.0,
                "interval_s": 0.5,
            },
        }
    )
    services = open_services(settings, clock=SystemClock())
    control = SessionService(services, RayActivator(services))
    r = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield Rig(services, control, r, redis_prefix)
    finally:
        await r.aclose()
        await services.close()


@pytest.fixture
async def rig(
    cluster: Cluster, s3_server: S3TestServer, redis_url: str, redis_prefix: str
) -> AsyncIterator[Rig]:
    async with opened_rig(s3_server, redis_url, redis_prefix) as r:
        yield r


async def test_the_work_runs_on_the_gpu_node_while_no_session_actor_lives(rig: Rig) -> None:
    sid = await rig.submit(hold=True)

    async def started() -> bool:
        return bool(await rig.counts("work:starts"))

    await eventually(started, timeout_s=60, what="the OCR task started")
    key = await rig.key_of(sid)
    gpu_node = ray.get_runtime_context().get_node_id()  # the driver's (head) node
    where = (await rig.where())[key]
    assert where["node"] != gpu_node
    fake_gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("fake_gpu")}
    assert where["node"] in fake_gpu_nodes, "the work ran on the node with the fake GPU"
    await eventually(lambda: not session_actors(rig.namespace), what="the session actor exited")
    assert await rig.state(sid) is S.SUSPENDED

    async def progress_shown() -> bool:
        return [(p.fraction, p.message) for p in await rig.control.progress(sid)] == [
            (0.4, "page 12/30")
        ]

    await eventually(progress_shown, what="the work's progress is visible, the session asleep")
    assert await rig.state(sid) is S.SUSPENDED, "a progress report wakes nothing"

    await rig.r.set(f"{rig.prefix}work:gate", "1")
    # No sweep: the answer comes straight from the work into the inbox, then a wake.
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session completes")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.result["ocr"]["result"]["pages"] == 30  # type: ignore[index]
    assert event_key(WORK_SOURCE, work_id(key)) in snap.processed_events
    assert await rig.counts("work:starts") == {key: 1}
    assert await rig.control.progress(sid) == [], "progress is cleared once the work ends"


async def _terminal(rig: Rig, sid: str) -> bool:
    return (await rig.state(sid)).terminal


async def test_a_failing_work_answers_its_error_and_a_large_result_goes_by_reference(
    rig: Rig,
) -> None:
    failing = await rig.submit(doc="F", fail=True)
    large = await rig.submit(doc="L", size=200_000)
    odd = await rig.submit(doc="O", odd=True)
    for sid in (failing, large, odd):
        await eventually(lambda s=sid: _terminal(rig, s), timeout_s=120, what="all finish")
    failed = await rig.services.snapshots.load(failing)
    error = failed.result["ocr"]["error"]  # type: ignore[index]
    assert error["code"] == "work_error" and "page 13 is unreadable" in error["message"]
    # A result JSON cannot hold is that run's answer: it was taken for a lost run, run
    # again (the same result, lost again) and answered "work_lost" long after.
    unusable = (await rig.services.snapshots.load(odd)).result["ocr"]["error"]  # type: ignore[index]
    assert unusable["code"] == "work_result_invalid" and "not JSON" in unusable["message"]
    assert sorted((await rig.counts("work:starts")).values()) == [1, 1, 1], "none ran again"
    big = await rig.services.snapshots.load(large)
    ref = big.result["ocr"]["result_ref"]  # type: ignore[index]
    stored = await rig.services.store.get(ref["key"])
    assert len(stored.data) == ref["bytes"] > 200_000
    assert json.loads(stored.data)["pages"] == 30


async def test_one_run_per_key_across_a_kill_of_the_session_process(rig: Rig) -> None:
    sid = await rig.submit(agent="scan_crash", hold=True)

    async def redispatched() -> bool:
        await rig.sweeper.sweep_once()
        await rig.control.drain()
        return max((await rig.counts("work:dispatches")).values(), default=0) >= 2

    # The first dispatch killed its session process (kill -9) before the outbox entry was
    # settled; the lease expires and the reconciler's re-activation dispatches again.
    await eventually(redispatched, timeout_s=90, interval_s=0.3, what="a second dispatch")
    await rig.r.set(f"{rig.prefix}work:gate", "1")
    await eventually(lambda: rig.finished(sid), timeout_s=90, interval_s=0.3, what="completes")
    key = await _only_key(rig)
    assert await rig.state(sid) is S.COMPLETED
    assert await rig.counts("work:starts") == {key: 1}, "the re-dispatch started nothing"
    assert await rig.counts("work:completions") == {key: 1}


async def _only_key(rig: Rig) -> str:
    keys = list(await rig.counts("work:starts"))
    assert len(keys) == 1, keys
    return keys[0]


async def test_a_killed_work_process_is_run_again_under_the_same_key(rig: Rig) -> None:
    sid = await rig.submit(hold=True)

    async def started() -> bool:
        return bool(await rig.where())

    await eventually(started, timeout_s=60, what="the OCR task started")
    key = await _only_key(rig)
    first = (await rig.where())[key]
    os.kill(first["pid"], signal.SIGKILL)  # kill -9 of the work's process

    async def rerun() -> bool:
        await rig.sweeper.sweep_once()  # the poll sees the lost run; the policy re-runs it
        return (await rig.where())[key]["run"] == 2

    await eventually(rerun, timeout_s=90, interval_s=0.3, what="the run was started again")
    assert (await rig.where())[key]["pid"] != first["pid"]
    await rig.r.set(f"{rig.prefix}work:gate", "1")
    await eventually(lambda: rig.finished(sid), timeout_s=90, interval_s=0.3, what="completes")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.result["ocr"]["result"]["run"] == 2  # type: ignore[index]
    assert await rig.counts("work:starts") == {key: 2}
    assert await rig.counts("work:completions") == {key: 1}, "one run finished, once"
    observed = {o.event_key for o in snap.observations}
    applied = [k for k in snap.processed_events if k not in observed]
    assert len(applied) == 1, "one answer applied"


async def test_cancel_stops_the_work(rig: Rig) -> None:
    sid = await rig.submit(hold=True)

    async def started() -> bool:
        return bool(await rig.where())

    await eventually(started, timeout_s=60, what="the OCR task started")
    key = await _only_key(rig)
    pid = (await rig.where())[key]["pid"]
    await rig.control.cancel(sid)
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session is cancelled")
    assert await rig.state(sid) is S.CANCELLED

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(gone, timeout_s=30, what="the work's process was stopped")
    await eventually(
        lambda: not _named(watcher_name(work_id(key)), rig.namespace), what="the watcher left"
    )
    assert await WorkRecords(rig.services.store).stopped(work_id(key))
    assert await rig.control.progress(sid) == [], "the stopped work's progress went with it"
    await rig.r.set(f"{rig.prefix}work:gate", "1")
    assert await rig.counts("work:completions") == {}


async def test_a_cancel_while_the_run_is_being_claimed_starts_no_work(
    cluster: Cluster, s3_server: S3TestServer, redis_url: str, redis_prefix: str
) -> None:
    """A slow store holds the run's claim: the cancel's stop reaches the watcher between
    its look at the stop record and the start of the task, finds nothing to cancel yet,
    and the task was started after it, to run to its end for a cancelled session."""
    proxy = FaultProxy(s3_server.endpoint).start()
    try:
        async with opened_rig(s3_server, redis_url, redis_prefix, endpoint=proxy.endpoint) as rig:
            proxy.delay(8.0, match=path_contains("/runs/", "PUT"))
            sid = await rig.submit(hold=True)

            async def claiming() -> bool:
                return proxy.stats.delayed >= 1

            await eventually(claiming, timeout_s=60, what="the watcher claims its run")
            await rig.control.cancel(sid)
            await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="cancelled")
            assert await rig.state(sid) is S.CANCELLED
            [work] = [k.split("/")[1] for k in await all_keys(rig.services.store, "work/")][:1]
            await eventually(
                lambda: not _named(watcher_name(work), rig.namespace),
                timeout_s=60,
                what="the watcher left without starting the work",
            )
            assert await rig.where() == {}, "the work of a cancelled session was started"
            await rig.r.set(f"{rig.prefix}work:gate", "1")
    finally:
        proxy.stop()


def _named(name: str, namespace: str) -> bool:
    named = ray.util.list_named_actors(all_namespaces=True)
    return any(a["name"] == name and a["namespace"] == namespace for a in named)


async def test_node_death_is_seen_by_the_poll_and_the_retry_policy_reruns_the_work(
    cluster: Cluster, rig: Rig
) -> None:
    sid = await rig.submit(hold=True)

    async def started() -> bool:
        return bool(await rig.where())

    await eventually(started, timeout_s=60, what="the OCR task started")
    key = await _only_key(rig)
    first_node = (await rig.where())[key]["node"]
    cluster.remove_node(cluster.gpu_node)  # type: ignore[attr-defined]
    cluster.gpu_node = cluster.add_node(num_cpus=1, resources={"fake_gpu": 1})  # type: ignore[attr-defined]
    cluster.wait_for_nodes()
    await rig.r.set(f"{rig.prefix}work:gate", "1")

    async def done() -> bool:
        return await rig.finished(sid)

    await eventually(done, timeout_s=120, interval_s=0.5, what="the work re-ran and answered")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED
    assert snap.result["ocr"]["result"]["run"] == 2  # type: ignore[index]
    assert (await rig.where())[key]["node"] != first_node
    assert await rig.counts("work:completions") == {key: 1}


async def test_an_actor_call_whose_watcher_is_lost_is_not_run_again_beside_it(
    rig: Rig,
) -> None:
    """A task dies with its watcher and a job is adopted by the next run, but a call of
    an actor's method goes on in the actor: a run again called it a second time while the
    first still ran. The wait is answered with the cause instead."""
    model = _model()
    try:
        sid = await rig.submit(agent="scan_model", hold=True)

        async def calling() -> bool:
            return bool(await rig.counts("model:calls"))

        await eventually(calling, timeout_s=60, what="the model's method runs")
        key = await rig.key_of(sid)
        ray.kill(ray.get_actor(watcher_name(work_id(key)), namespace=rig.namespace))

        async def answered() -> bool:
            return await rig.finished(sid)

        await eventually(answered, timeout_s=90, interval_s=0.5, what="the wait is answered")
        snap = await rig.services.snapshots.load(sid)
        assert snap.state is S.FAILED and snap.error is not None
        assert "not started again" in snap.error.message
        assert await rig.counts("model:calls") == {key: 1}
    finally:
        await rig.r.set(f"{rig.prefix}work:gate", "1")
        ray.kill(model)


async def test_an_actor_that_is_not_there_is_the_answer_at_once(rig: Rig) -> None:
    """No model actor deployed: a run again would not find it either. It was taken for a
    lost run, run again, and answered "its node or process died" after the polls."""
    sid = await rig.submit(agent="scan_model")
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session ends")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.FAILED and snap.error is not None
    assert "could not be started" in snap.error.message and "ocr-model" in snap.error.message


def _model() -> Any:
    return (
        ray.remote(OcrModel)
        .options(name="ocr-model", namespace=MODEL_NAMESPACE, num_cpus=0, resources={"fake_gpu": 1})
        .remote()
    )


async def test_a_named_actors_method_is_the_work(rig: Rig) -> None:
    model = _model()
    try:
        sid = await rig.submit(agent="scan_model")
        await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session completes")
        snap = await rig.services.snapshots.load(sid)
        assert snap.state is S.COMPLETED, snap.error
        answer = snap.result["ocr"]["result"]  # type: ignore[index]
        assert answer["pages"] == 7
        fake_gpu_nodes = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("fake_gpu")}
        assert answer["node"] in fake_gpu_nodes, "the model's own actor answered"
        assert list((await rig.counts("model:calls")).values()) == [1]
    finally:
        ray.kill(model)


# --- §2: sync tools executed as Ray tasks -----------------------------------------------


async def test_a_task_executed_tool_runs_outside_the_session_actor_and_is_logged_once(
    rig: Rig,
) -> None:
    sid = await rig.submit(agent="parse")
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session completes")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED, snap.error
    here, parse = snap.result["here"], snap.result["parse"]  # type: ignore[index]
    assert parse["pid"] != here["pid"], "the task ran in a process of its own"
    logged = [e for e in snap.tool_log.values() if e.tool_name == "heavy_parse"]
    assert len(logged) == 1 and logged[0].key == parse["key"]
    assert await rig.counts("task:runs") == {parse["key"]: 1}


async def test_a_task_executed_tool_times_out_as_configured(rig: Rig) -> None:
    sid = await rig.submit(agent="parse_slow")
    # Each timed-out call is retried (same key) from a retry timer the reconciler serves.
    await eventually(lambda: rig.finished(sid), timeout_s=120, interval_s=0.3, what="it ends")
    snap = await rig.services.snapshots.load(sid)
    parse = snap.result["parse"]  # type: ignore[index]
    assert parse["error"]["code"] == "call_timed_out", parse
    assert "1 s" in parse["error"]["message"]
    logged = [e for e in snap.tool_log.values() if e.tool_name == "slow_parse"]
    assert len(logged) == 1
    assert await rig.counts("task:slow_done") == {}
