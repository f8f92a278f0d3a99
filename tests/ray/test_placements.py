"""The session runtime on a real local Ray, in both placements, same suite.

Storage is the S3 test server over HTTP plus a real Redis. Each test gets a namespace of
its own, so actors from one test are never confused with another's.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import redis

from actors import pool_hosts, ray_activator
from actors.config_ref import ConfigRef
from actors.pool import PoolHost, host_name, pool_channel
from actors.ray_activator import RayActivator, pool_slot
from actors.reconciler import NAME as RECONCILER
from actors.reconciler import ensure_reconciler
from tests.conftest import eventually
from tests.ray.conftest import RayEnv, session_actors
from tests.support.harness import callback
from torpor.events import EventKind, InboxEvent
from torpor.faults import ENV, ONCE_ENV, CrashPoint
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason
from torpor.ports import Reason, Wanted
from torpor.service.batches import BatchService

ROOT = Path(__file__).resolve().parents[2]
S = SessionState
PLACEMENTS = ["dedicated", "pooled"]


async def state_of(env: RayEnv, sid: str) -> SessionState:
    return (await env.load(sid)).state


async def reach(env: RayEnv, sid: str, state: SessionState, *, timeout_s: float = 30) -> None:
    """The session is in ``state`` and no activation is still busy with it (a suspend
    commits its state before it binds the wait and sends the request)."""

    async def check() -> bool:
        return await state_of(env, sid) is state and await idle(env)

    await eventually(check, timeout_s=timeout_s, what=f"{sid} reaches {state}")


async def no_session_actors(env: RayEnv) -> bool:
    return not session_actors(env.settings.namespace)


async def idle(env: RayEnv) -> bool:
    """No activation is running anywhere: no session actor, no busy pool host."""
    if session_actors(env.settings.namespace):
        return False
    for slot in range(env.settings.pool.size):
        try:
            host = ray.get_actor(host_name(slot), namespace=env.settings.namespace)
        except ValueError:
            continue
        if (await host.stats.remote())["running"]:
            return False
    return True


async def host_activations(env: RayEnv, sid: str) -> int:
    """The activations the session's pool host has run (0 while it has none)."""
    try:
        host = ray.get_actor(
            host_name(pool_slot(sid, env.settings.pool.size)), namespace=env.settings.namespace
        )
    except ValueError:
        return 0
    return int((await host.stats.remote())["activations"])


async def test_a_session_actor_slower_to_start_than_the_answers_deadline_still_runs(
    make_ray_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The activation's deadline for an answer counted the new actor's process start: in
    a burst on a busy node each start took longer, each actor was killed before it
    answered and made again, and no session ran (``make demo`` beside other work: 49 of
    50 sessions PENDING for minutes). Here every start is longer than the deadline. It
    also fails when the answer to ``activate`` waits behind the run's own start (its
    imports and its services' open held the actor's loop first: 0.8 s an answer)."""
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 0.5)  # a process start: >1 s
    async with make_ray_env(placement="dedicated") as env:
        sid = await env.submit(doc="PR-slow-start")
        await reach(env, sid, S.SUSPENDED)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_sleeps_with_zero_actors_and_wakes_on_event(
    make_ray_env: Any, placement: str
) -> None:
    async with make_ray_env(placement=placement) as env:
        sids = [await env.submit(doc=f"PR-{i}") for i in range(3)]
        for sid in sids:
            await reach(env, sid, S.SUSPENDED)
        await eventually(lambda: no_session_actors(env), what="every session actor exited")
        for sid in sids:
            await env.answer(sid, {"status": "approved"})
        for sid in sids:
            await reach(env, sid, S.COMPLETED)
        await eventually(lambda: no_session_actors(env), what="actors exit after completing")
        assert await env.world.counts("dispatch") == {f"acme:approve:PR-{i}:1": 1 for i in range(3)}


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_kill_9_mid_run_recovers_without_repeating_effects(
    make_ray_env: Any, placement: str
) -> None:
    async with make_ray_env(placement=placement, hold="extract") as env:
        sid = await env.submit(doc="PR-K")

        async def held() -> bool:
            return "PR-K" in await env.world.entries("held")

        await eventually(held, what="the sync tool ran its side effect and is held")
        name = (
            f"session:{sid}"
            if placement == "dedicated"
            else host_name(pool_slot(sid, env.settings.pool.size))
        )
        actor = ray.get_actor(name, namespace=env.settings.namespace)
        where = await actor.where.remote()
        os.kill(where["pid"], signal.SIGKILL)
        await env.world.open_gate("extract")
        assert (await env.load(sid)).state is S.RUNNING  # the crash lost the uncommitted step

        async def recovered() -> bool:
            await env.sweeper.sweep_once()
            await env.control.drain()
            return await state_of(env, sid) is S.SUSPENDED

        await eventually(recovered, timeout_s=60, interval_s=0.5, what="recovered by the sweeper")
        # The re-run used the same idempotency key: the external ledger has one effect.
        extract_calls = await env.world.counts("extract")
        assert len(extract_calls) == 1 and list(extract_calls.values()) == [2]

        # SUSPENDED is committed before its outbox is drained: the request goes out after.
        async def dispatched() -> bool:
            return list(await env.world.counts("dispatch")) == ["acme:approve:PR-K:1"]

        await eventually(dispatched, what="the recovered suspend sent its request")
        await env.answer(sid, {"status": "approved"})
        await reach(env, sid, S.COMPLETED)
        assert all(n == 1 for n in (await env.world.counts("dispatch")).values())


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_ten_concurrent_activations_commit_once(make_ray_env: Any, placement: str) -> None:
    async with make_ray_env(placement=placement) as env:
        sid = await env.submit(doc="PR-C")
        await reach(env, sid, S.SUSPENDED)
        wait = (await env.load(sid)).waits[0]
        await env.services.inbox.deliver(
            callback(sid, wait, event_id="e1", data={"status": "approved"}, at=env.clock.now())
        )
        before = (await env.load(sid)).generation
        await asyncio.gather(
            *(env.control.activator.request(sid, reason=Reason.EVENT) for _ in range(10))
        )
        await reach(env, sid, S.COMPLETED)
        await eventually(lambda: no_session_actors(env), what="all actors gone")
        snap = await env.load(sid)
        assert snap.generation == before + 2
        assert [m.tool_call_id for m in snap.messages if m.role == "tool"] == [
            "call_extract_1_0",
            "call_approve_1_0",
        ]


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_stale_event_is_observe_only(make_ray_env: Any, placement: str) -> None:
    async with make_ray_env(placement=placement) as env:
        sid = await env.submit(doc="PR-S")
        await reach(env, sid, S.SUSPENDED)
        before = await env.load(sid)
        await env.answer(sid, {"status": "rejected"}, event_id="late", epoch=before.epoch - 1)

        async def observed() -> bool:
            return len((await env.load(sid)).observations) == 1

        await eventually(observed, what="the stale event was recorded")
        after = await env.load(sid)
        assert after.state is S.SUSPENDED and after.messages == before.messages
        assert after.observations[0].reason is ObservationReason.STALE


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_sla_expiry_times_out_and_compensates_once(make_ray_env: Any, placement: str) -> None:
    async with make_ray_env(placement=placement, sla_s=1.0) as env:
        sid = await env.submit(doc="PR-T")
        await reach(env, sid, S.SUSPENDED)

        async def timed_out() -> bool:
            await env.sweeper.sweep_once()
            await env.control.drain()
            return await state_of(env, sid) is S.TIMED_OUT

        await eventually(timed_out, timeout_s=30, interval_s=0.3, what="timed out")
        for _ in range(3):  # more sweeps, more activations: still one compensation
            await env.sweeper.sweep_once()
        ran = await host_activations(env, sid)
        await env.control.activator.request(sid, reason=Reason.TIMEOUT)

        async def settled() -> bool:
            # The compensation is sent after the TIMED_OUT commit (the outbox drains
            # behind it), and a pool host runs the request above behind the call, with
            # no session actor to wait for: read at once, the count could be the one
            # before either. A dedicated actor is named before ``request`` returns.
            taken = placement == "dedicated" or await host_activations(env, sid) > ran
            return taken and await idle(env)

        await eventually(settled, what="the timeout's activations are done")
        assert await env.world.counts("compensate") == {"acme:approve:PR-T:1:compensate": 1}


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_drift_replans(make_ray_env: Any, placement: str) -> None:
    async with make_ray_env(placement=placement) as env:
        sid = await env.submit(doc="PR-D")
        await reach(env, sid, S.SUSPENDED)
        await env.world.set_version("PR-D", "v2")
        await env.answer(sid, {"status": "approved"}, event_id="a1")

        async def replanned() -> bool:
            snap = await env.load(sid)
            return snap.state is S.SUSPENDED and snap.epoch == 3 and await idle(env)

        await eventually(replanned, what="a new approval wait after drift")
        await env.answer(sid, {"status": "approved"}, event_id="a2")
        await reach(env, sid, S.COMPLETED)
        assert (await env.load(sid)).result == {"decision": "approved", "doc": "PR-D"}


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_flushed_redis_is_rebuilt_and_sessions_still_resume(
    make_ray_env: Any, placement: str, redis_url: str, redis_prefix: str
) -> None:
    async with make_ray_env(placement=placement) as env:
        sids = [await env.submit(doc=f"PR-F{i}") for i in range(4)]
        for sid in sids:
            await reach(env, sid, S.SUSPENDED)
        cids = {sid: (await env.load(sid)).waits[0].correlation_id for sid in sids}
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=redis_prefix + "*"):
            if b"world:" not in key:  # keep the simulated OA/ERP world; lose the index
                client.delete(key)
        client.close()
        assert (
            await env.services.index.resolve(
                tenant="acme", now=env.clock.now(), correlation_id=cids[sids[0]]
            )
            is None
        )
        report = await env.sweeper.sweep_once()
        assert report.repaired_waits == 4
        for sid in sids:
            assert await env.services.index.resolve(
                tenant="acme", now=env.clock.now(), correlation_id=cids[sid]
            )
            assert await env.services.index.resolve(
                tenant="acme", now=env.clock.now(), business_key=f"PR-F{sids.index(sid)}"
            )
            await env.answer(sid, {"status": "approved"})
        for sid in sids:
            await reach(env, sid, S.COMPLETED)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_overdue_wait_is_polled(make_ray_env: Any, placement: str) -> None:
    async with make_ray_env(placement=placement, expected_s=0.5) as env:
        sid = await env.submit(doc="PR-P")
        await reach(env, sid, S.SUSPENDED)
        await env.world.decide("PR-P", {"status": "approved", "via": "poll"})

        async def polled() -> bool:
            await env.sweeper.sweep_once()
            await env.control.drain()
            return await state_of(env, sid) is S.COMPLETED

        await eventually(polled, timeout_s=30, interval_s=0.3, what="completed through a poll")
        assert len(await env.world.counts("poll")) == 1


START_RECONCILER_AND_EXIT = """
import base64, pickle, sys
import ray
from actors.reconciler import ensure_reconciler

settings = pickle.loads(base64.b64decode(sys.argv[2]))
ray.init(address=sys.argv[1], namespace=settings.namespace, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": sys.argv[3]}})
print(ensure_reconciler(settings)._actor_id.hex())
"""


async def test_reconciler_is_a_detached_named_singleton(make_ray_env: Any) -> None:
    async with make_ray_env() as env:
        # Started by a driver that then exits: a detached actor outlives its creator.
        settings = base64.b64encode(pickle.dumps(env.settings)).decode()
        address = ray.get_runtime_context().gcs_address
        child = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", START_RECONCILER_AND_EXIT, address, settings, str(ROOT)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert child.returncode == 0, child.stderr[-2000:]
        created = child.stdout.strip().splitlines()[-1]
        found = ray.get_actor(RECONCILER, namespace=env.settings.namespace)
        assert found._actor_id.hex() == created
        second = ensure_reconciler(env.settings)
        assert second._actor_id == found._actor_id
        status = ray.get(found.status.remote())
        assert status["running"]
        sweeps = status["sweeps"]
        sid = await env.submit(doc="PR-R")
        await reach(env, sid, S.SUSPENDED)

        def swept() -> bool:
            return ray.get(found.status.remote())["sweeps"] >= sweeps + 2

        await eventually(swept, what="the reconciler sweeps on after its creator exited")
        ray.kill(found, no_restart=True)


async def test_pool_hosts_are_named_in_the_namespace(make_ray_env: Any) -> None:
    async with make_ray_env(placement="pooled") as env:
        sid = await env.submit(doc="PR-H")
        await reach(env, sid, S.SUSPENDED)
        names = {host_name(0), host_name(1)}
        from ray.util import list_named_actors

        found = {
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a["namespace"] == env.settings.namespace
        }
        assert found & names
        assert not session_actors(env.settings.namespace)


async def test_warming_starts_every_pool_host_before_any_request(make_ray_env: Any) -> None:
    # A host's start (a process, imports, its services: seconds on a busy node) is paid
    # once, up front, not by the requests routed to it meanwhile (the bench's p99).
    async with make_ray_env(placement="pooled") as env:
        from ray.util import list_named_actors

        activator = RayActivator(env.services)
        await activator.warm()
        found = {
            a["name"]
            for a in list_named_actors(all_namespaces=True)
            if a["namespace"] == env.settings.namespace
        }
        assert {host_name(slot) for slot in range(env.settings.pool.size)} <= found
        await activator.close()


async def test_python_client_end_to_end(make_ray_env: Any) -> None:
    from torpor.client import Client

    async with make_ray_env(placement="pooled") as env:
        client = Client(env.settings, tenant="acme", start_reconciler=False)
        try:
            sid = client.submit("purchase", {"doc": "PR-CL", "amount": 10.0})

            async def waiting() -> bool:
                return client.get(sid).state is S.SUSPENDED and await idle(env)

            await eventually(waiting, what="client session waits")
            view = client.get(sid)
            [wait] = view.waits
            assert wait.tool == "request_approval" and wait.business_key == "PR-CL"
            assert client.send_event(
                sid,
                event_id="human-1",
                type="oa.approval.decided",
                data={"status": "approved"},
                business_key="PR-CL",
            )
            done = client.wait(sid, timeout_s=30)
            assert done.state is S.COMPLETED and done.result == {
                "decision": "approved",
                "doc": "PR-CL",
            }

            other = client.submit("purchase", {"doc": "PR-CX"})
            await eventually(lambda: client.get(other).state is S.SUSPENDED, what="second waits")
            assert client.cancel(other).session_id == other
            assert client.wait(other, timeout_s=30).state is S.CANCELLED

            batch = client.submit_batch("purchase", [{"doc": f"PR-B{i}"} for i in range(4)])
            seen: list[dict[str, Any]] = []

            async def all_waiting() -> bool:
                return client.progress(batch)["by_state"] == {"SUSPENDED": 4} and await idle(env)

            await eventually(all_waiting, what="batch sessions wait")
            for i, sid_b in enumerate(
                env_batch_ids := (await BatchService(env.control).get(batch)).session_ids
            ):
                client.send_event(
                    sid_b,
                    event_id=f"d{i}",
                    type="oa.approval.decided",
                    data={"status": "approved"},
                    business_key=f"PR-B{i}",
                )
            final = client.wait_batch(batch, timeout_s=60, on_progress=seen.append, interval_s=0.2)
            assert final["done"] == final["total"] == len(env_batch_ids) == 4
            assert final["by_state"] == {"COMPLETED": 4}
            assert seen[-1] == final
        finally:
            client.close()


async def test_a_pool_host_takes_requests_from_its_channel(make_ray_env: Any) -> None:
    async with make_ray_env(placement="pooled") as env:
        sid = await env.submit(doc="PR-Q")
        await reach(env, sid, S.SUSPENDED)
        snap = await env.load(sid)
        wait = snap.waits[0]
        binding = await env.services.index.resolve(
            tenant=snap.tenant, now=env.clock.now(), correlation_id=wait.correlation_id
        )
        assert binding is not None
        # The answer is stored with no activation asked for, then one request is put on
        # the host's channel in Redis: no Ray call reaches the host.
        await env.services.inbox.deliver(
            InboxEvent.new(
                kind=EventKind.CALLBACK,
                session_id=sid,
                source="oa",
                event_id="evt-q",
                type="oa.approval.decided",
                received_at=env.clock.now(),
                correlation_id=wait.correlation_id,
                epoch=binding.epoch,
                step_id=binding.step_id,
                data={"status": "approved"},
            )
        )
        queue = env.services.activations
        assert queue is not None
        slot = pool_slot(sid, env.settings.pool.size)
        channel = pool_channel(env.settings.namespace, slot)
        await queue.push(channel, Wanted(sid, Reason.EVENT, time.time()))
        await reach(env, sid, S.COMPLETED)


async def test_a_host_killed_after_it_took_a_recovery_off_its_channel_loses_nothing(
    make_ray_env: Any, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A host dies holding a session, the index is lost, and the repair asks for the
    session's recovery; the host takes the request off its channel and is killed before
    it leases the session (the chaos run that failed CI: host 1 killed, index flushed).
    The repair had let go once the request was taken: nothing asked again, and the
    session stayed RUNNING for ever. The wake-up timer it now arms first asks again."""
    async with make_ray_env(placement="pooled", hold="extract") as env:
        # Hosts of the test's own, made before the activator asks: each dies the first
        # time any of them takes a recovery off its channel, and only then (restarted by
        # Ray with the same environment, it goes on).
        config = ConfigRef.of(env.settings)
        crash = {
            "PYTHONPATH": str(ROOT),
            ENV: f"{CrashPoint.POOL_TAKEN}.{Reason.RECOVER.value}",
            ONCE_ENV: str(tmp_path),
        }
        for slot in range(env.settings.pool.size):
            PoolHost.options(  # type: ignore[attr-defined]
                name=host_name(slot),
                namespace=env.settings.namespace,
                get_if_exists=True,
                lifetime="detached",
                runtime_env={"env_vars": crash},
            ).remote(config, slot)
        sid = await env.submit(doc="PR-T")

        async def held() -> bool:
            return "PR-T" in await env.world.entries("held")

        await eventually(held, what="the sync tool ran its side effect and is held")
        host = ray.get_actor(
            host_name(pool_slot(sid, env.settings.pool.size)), namespace=env.settings.namespace
        )
        os.kill((await host.where.remote())["pid"], signal.SIGKILL)  # dies holding the lease
        await env.world.open_gate("extract")
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=redis_prefix + "*"):
            if b"world:" not in key:  # keep the simulated OA/ERP world; lose the index
                client.delete(key)
        client.close()
        killed = tmp_path / f"{CrashPoint.POOL_TAKEN}.{Reason.RECOVER.value}"

        async def recovered() -> bool:
            await env.sweeper.sweep_once()
            await env.control.drain()
            return await state_of(env, sid) is S.SUSPENDED

        await eventually(recovered, timeout_s=60, interval_s=0.5, what="recovered by the sweeper")
        assert killed.exists(), "a host took the recovery and was killed there"
        assert len(await env.world.counts("extract")) == 1


async def test_a_pool_host_gone_for_good_is_made_again(
    make_ray_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with make_ray_env(placement="pooled") as env:
        sid = await env.submit(doc="PR-G")
        await reach(env, sid, S.SUSPENDED)
        host = ray.get_actor(
            host_name(pool_slot(sid, env.settings.pool.size)), namespace=env.settings.namespace
        )
        # Killed without a restart: its listener is gone with it, and the activator still
        # holds its handle. A request now waits on a channel nobody takes from...
        pid = (await host.where.remote())["pid"]
        ray.kill(host, no_restart=True)

        def gone() -> bool:
            # Ray calls the actor dead before its process is: a host still blocked on its
            # channel could take the request below and die with it (a loss its timer
            # repairs, with a reconciler, which this test does not run).
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        await eventually(gone, what="the pool host's process is gone")
        monkeypatch.setattr(pool_hosts, "STALLED_CHANNEL", 1)  # ...which the push sees
        await env.answer(sid, {"status": "approved"})
        await env.control.drain()
        await reach(env, sid, S.COMPLETED)
