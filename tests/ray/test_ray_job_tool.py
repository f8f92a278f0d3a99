"""A Ray Job as a long-running tool, on a real single-node local Ray with its dashboard.

The Job API needs the node's dashboard agent. Its HTTP port defaults to 52365 for every
Ray on the machine, so next to another Ray (or a second node of a
``ray.cluster_utils.Cluster`` on the same host) the agent cannot bind, and every submit
answers "No available agent to submit job". ``ray.init`` cannot choose that port, so this
module starts one head node of its own with the dashboard on free ports and connects to
it (never to another cluster on the machine). The S3 test server holds the sessions and
the work records.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.job_submission import JobStatus, JobSubmissionClient

from actors.ray_activator import RayActivator
from actors.ray_work import watcher_name
from actors.wiring import open_services
from storage.work import WorkRecords
from tests.conftest import eventually, make_bucket
from tests.ray.conftest import session_actors
from tests.support.job_tools import job_agents
from tests.support.s3_server import S3TestServer, free_port
from torpor.clock import SystemClock
from torpor.ids import business_idempotency_key
from torpor.lifecycle import SessionState
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings
from torpor.work import work_id

ROOT = Path(__file__).resolve().parents[2]
S = SessionState


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobSubmissionClient]:
    head = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": True,
            "dashboard_port": free_port(),
            "dashboard_agent_listen_port": 0,  # any free port: 52365 may be taken
        },
    )
    ray.init(
        address=head.address,
        namespace="jobs-" + os.urandom(4).hex(),
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    url = ray._private.worker.global_worker.node.address_info["webui_url"]
    yield JobSubmissionClient(f"http://{url}")
    ray.shutdown()
    head.shutdown()


class Rig:
    def __init__(self, control: SessionService, jobs: JobSubmissionClient, gate: Path) -> None:
        self.control, self.jobs, self.gate = control, jobs, gate
        self.services = control.services
        self.sweeper = Sweeper(control)
        self.namespace = self.services.settings.namespace
        self.records = WorkRecords(self.services.store)

    async def submit(self, corpus: str = "corpus-3") -> str:
        body = {"corpus": corpus, "gate": str(self.gate)}
        return (await self.control.submit(tenant="acme", agent="finetune", input=body)).session_id

    async def state(self, sid: str) -> SessionState:
        return (await self.services.snapshots.load(sid)).state

    async def terminal(self, sid: str) -> bool:
        await self.sweeper.sweep_once()
        await self.control.drain()
        return (await self.state(sid)).terminal

    async def work_of(self, sid: str) -> str:
        snap = await self.services.snapshots.load(sid)
        wait = snap.waits[0]
        return work_id(business_idempotency_key(snap.tenant, wait.action_key, wait.epoch))

    def submissions(self, work: str) -> list[str]:
        return sorted(
            str(j.submission_id)
            for j in self.jobs.list_jobs()
            if str(j.submission_id).startswith(work)
        )

    def status(self, submission: str) -> JobStatus:
        return self.jobs.get_job_status(submission)  # type: ignore[no-any-return]

    async def running_job(self, sid: str) -> tuple[str, str]:
        """Once the session's job runs: its work id and its only submission."""

        async def running() -> bool:
            snap = await self.services.snapshots.load(sid)
            if not snap.waits:
                return False
            subs = self.submissions(await self.work_of(sid))
            return len(subs) == 1 and self.status(subs[0]) is JobStatus.RUNNING

        await eventually(running, timeout_s=60, what="the job runs")
        work = await self.work_of(sid)
        return work, self.submissions(work)[0]


@pytest.fixture
async def rig(
    jobs: JobSubmissionClient,
    s3_server: S3TestServer,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> AsyncIterator[Rig]:
    bucket = "jobs-" + os.urandom(4).hex()
    make_bucket(s3_server, bucket)
    kw = s3_server.boto_kwargs()
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": f"s3://{bucket}/t",
                "s3": {
                    "endpoint_url": kw["endpoint_url"],
                    "region": kw["region"],
                    "access_key_id": kw["access_key_id"],
                    "secret_access_key": kw["secret_access_key"],
                },
                "index_url": redis_url,
                "redis_prefix": redis_prefix,
            },
            "namespace": "j" + os.urandom(4).hex(),
            "agents": job_agents(),
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
    try:
        yield Rig(control, jobs, tmp_path / "gate")
    finally:
        await services.close()


async def test_the_job_runs_while_the_session_sleeps_and_its_result_completes_it(
    rig: Rig,
) -> None:
    sid = await rig.submit("corpus-3")
    work, submission = await rig.running_job(sid)
    assert submission.startswith(work), "the submission id is derived from the work id"
    await eventually(lambda: not session_actors(rig.namespace), what="the session actor exited")
    assert await rig.state(sid) is S.SUSPENDED

    rig.gate.touch()
    # No sweep: the watcher writes the job's answer into the inbox and asks for a wake.
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session completes")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED, snap.error
    answer = snap.result["train"]  # type: ignore[index]
    assert answer["status"] == "ok", answer
    assert answer["result"]["submission_id"] == submission
    assert answer["result"]["status"] == "SUCCEEDED"
    assert 'RESULT {"trained_on": "corpus-3"' in answer["result"]["logs_tail"]
    assert rig.submissions(work) == [submission]


async def _terminal(rig: Rig, sid: str) -> bool:
    return (await rig.state(sid)).terminal


async def test_a_redispatch_after_a_lost_watcher_adopts_the_running_job(rig: Rig) -> None:
    sid = await rig.submit("corpus-7")
    work, submission = await rig.running_job(sid)
    ray.kill(ray.get_actor(watcher_name(work), namespace=rig.namespace))

    async def redispatched() -> bool:
        await rig.sweeper.sweep_once()  # the poll sees no watcher: lost, the policy re-runs
        await rig.control.drain()
        return await rig.records.runs(work) >= 2 and _named(watcher_name(work), rig.namespace)

    await eventually(redispatched, timeout_s=60, interval_s=0.3, what="a second dispatch")
    assert rig.status(submission) is JobStatus.RUNNING, "the job outlived its watcher"
    rig.gate.touch()
    await eventually(lambda: rig.terminal(sid), timeout_s=60, interval_s=0.3, what="completes")
    snap = await rig.services.snapshots.load(sid)
    assert snap.state is S.COMPLETED, snap.error
    assert snap.result["train"]["result"]["submission_id"] == submission  # type: ignore[index]
    assert rig.submissions(work) == [submission], "the re-dispatch submitted no second job"


def _named(name: str, namespace: str) -> bool:
    named = ray.util.list_named_actors(all_namespaces=True)
    return any(a["name"] == name and a["namespace"] == namespace for a in named)


async def test_cancel_stops_the_job(rig: Rig) -> None:
    sid = await rig.submit("corpus-9")
    work, submission = await rig.running_job(sid)
    await cancel_and_see_the_job_stopped(rig, sid, submission)
    await eventually(lambda: not _named(watcher_name(work), rig.namespace), what="watcher left")
    assert await rig.records.stopped(work)
    assert await rig.records.outcome(work) is None
    assert rig.submissions(work) == [submission]


async def test_a_job_stopped_outside_torpor_is_the_answer_and_never_submitted_again(
    rig: Rig,
) -> None:
    """``ray job stop`` by an operator: its watcher took the STOPPED job for a stop of
    torpor's own, recorded nothing, and the poll then ran it again as lost (a second
    submission, or "work_lost" once the runs were spent)."""
    sid = await rig.submit("corpus-s")
    work, submission = await rig.running_job(sid)
    rig.jobs.stop_job(submission)
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the wait is answered")
    snap = await rig.services.snapshots.load(sid)
    error = snap.result["train"]["error"]  # type: ignore[index]
    assert error["code"] == "work_stopped" and "outside torpor" in error["message"]
    assert rig.submissions(work) == [submission]


async def test_a_cancel_stops_the_job_whose_watcher_is_gone(rig: Rig) -> None:
    """A job outlives its watcher: with no watcher to ask, the stop found "nothing runs"
    and left the job running for a cancelled session."""
    sid = await rig.submit("corpus-w")
    work, submission = await rig.running_job(sid)
    ray.kill(ray.get_actor(watcher_name(work), namespace=rig.namespace))
    await eventually(lambda: not _named(watcher_name(work), rig.namespace), what="watcher gone")
    await cancel_and_see_the_job_stopped(rig, sid, submission)


async def cancel_and_see_the_job_stopped(rig: Rig, sid: str, submission: str) -> None:
    await rig.control.cancel(sid)
    await eventually(lambda: _terminal(rig, sid), timeout_s=60, what="the session is cancelled")
    assert await rig.state(sid) is S.CANCELLED

    async def stopped() -> bool:
        return rig.status(submission) is JobStatus.STOPPED

    await eventually(stopped, timeout_s=30, what="the job was stopped")
