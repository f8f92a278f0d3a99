"""The Ray work runner's own decisions, with Ray's calls replaced (no cluster started):
what it reads as a lost run, and what its task executor keeps between calls."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import ray
import requests
from pydantic import JsonValue
from ray.exceptions import (
    ActorUnavailableError,
    GetTimeoutError,
    OutOfMemoryError,
    RaySystemError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.job_submission import JobStatus

from actors import ray_work, work_delivery, work_jobs, work_watcher
from actors.config_ref import ConfigRef
from actors.ray_work import (
    Kind,
    Launch,
    RayTaskExecutor,
    RayWorkRunner,
    WorkContext,
    WorkWatcher,
)
from storage.memory_store import MemoryObjectStore
from storage.work import WorkRecords
from tests.support.actor_globals import patch_global
from tests.unit.test_work import order
from torpor.backoff import fixed
from torpor.errors import (
    SessionNotFound,
    StorageUnavailable,
    WorkStartFailed,
    WorkStartUnanswered,
    WorkStopFailed,
)
from torpor.settings import Settings
from torpor.tools import ToolContext
from torpor.work import (
    Fail,
    Rerun,
    RetryPolicy,
    TaskExecution,
    WorkOrder,
    WorkState,
    after_loss,
)

NOW = datetime(2026, 11, 30, tzinfo=UTC)


def an_order() -> WorkOrder:
    """A work order of one tool call (the work module's own tests' order)."""
    return order()


async def a_runner(launch: Launch, order: WorkOrder) -> RayWorkRunner:
    """A runner whose records are in memory, with run 1 of ``order`` claimed."""
    runner = RayWorkRunner(launch)
    runner.configure(Settings())
    runner._records = WorkRecords(MemoryObjectStore())
    await runner.records.save_order(order)
    assert await runner.records.claim_run(order.work_id, 1, by="watcher")
    return runner


class Watcher:
    """A watcher handle whose ``state`` call fails as ``answer`` says."""

    def __init__(self, answer: Any) -> None:
        self.state = self
        self._answer = answer

    def remote(self) -> Any:
        return self._answer()


async def unreachable() -> dict[str, Any]:
    raise ActorUnavailableError("the actor is temporarily unavailable", None)


async def silent() -> dict[str, Any]:
    await asyncio.sleep(3600)
    return {"running": True}


@pytest.mark.parametrize("answer", [unreachable, silent], ids=["unavailable", "no_answer"])
async def test_a_watcher_that_cannot_be_reached_for_a_moment_is_not_a_lost_run(
    answer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An actor call's watcher, alive but unreachable for a moment (a network blip, a busy
    node): its run is not lost. Taken for lost, the poll answered the wait with
    ``work_lost`` (an actor call is never run again beside itself) while the call ran on,
    and its real answer, arriving later, found the wait already closed."""
    monkeypatch.setattr(ray_work, "STATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: Watcher(answer))
    order = an_order()
    runner = await a_runner(Launch(Kind.ACTOR, actor="model", method="embed"), order)
    status = await runner.status(order.work_id)
    assert status.state is not WorkState.LOST, status


class SilentWatcher:
    """A watcher handle (for ``create_named`` to return) whose ``start`` is never
    answered, as one whose process never came up (its node gone, not yet declared dead)."""

    def __init__(self) -> None:
        self.start = self
        self.asked = 0

    def remote(self, run: int) -> asyncio.Future[Any]:
        self.asked += 1
        return asyncio.get_running_loop().create_future()


class LateWatcher:
    """A real watcher (its class, in this process) behind a handle that holds the first
    ``start`` until ``release`` is set. As with Ray, the caller giving up on the answer
    does not take the call back: it lands later all the same."""

    def __init__(self, watcher: Any) -> None:
        self.start = self
        self.asked = 0
        self.release = asyncio.Event()
        self._watcher = watcher
        self._calls: list[asyncio.Task[Any]] = []

    def remote(self, run: int) -> asyncio.Future[Any]:
        self.asked += 1
        first = self.asked == 1

        async def call() -> Any:
            if first:
                await self.release.wait()
            return await self._watcher.start(run)

        self._calls.append(asyncio.create_task(call()))
        return asyncio.shield(self._calls[-1])  # an ObjectRef's wait, not the call


def made(handle: Any) -> Any:
    async def create_named(*args: Any, **options: Any) -> Any:
        return handle

    return create_named


async def test_a_watcher_that_never_answers_its_start_fails_the_start_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher's ``start`` had no deadline: one whose process never came up (its node
    gone, not yet declared dead) held the dispatch, and the reconciler's poll that reruns
    a lost work, until an outer deadline, if any. It is now a typed, retryable failure
    within the deadline, asked once, with the order saved for the retry."""
    monkeypatch.setattr(ray_work, "WATCHER_START_TIMEOUT_S", 0.1)
    silent = SilentWatcher()
    monkeypatch.setattr(ray_work, "create_named", made(silent))
    order = an_order()
    runner = RayWorkRunner(Launch(Kind.TASK, fn=lambda args, ctx: None))
    runner.configure(Settings())
    runner._records = WorkRecords(MemoryObjectStore())
    started = time.monotonic()
    async with asyncio.timeout(5):  # before: waited here until this deadline
        with pytest.raises(WorkStartUnanswered) as raised:
            await runner.start(order)
    assert time.monotonic() - started < 2
    assert raised.value.retryable and isinstance(raised.value, TimeoutError)
    assert silent.asked == 1, "a silent watcher was asked again: the caller held longer"
    saved = await runner.records.order(order.work_id)
    assert saved is not None and saved.work_id == order.work_id, "the order was lost"


class ExitingWatcher:
    """A watcher handle whose every ``start`` finds it going (Ray's "unavailable")."""

    def __init__(self) -> None:
        self.start = self
        self.asked = 0

    def remote(self, run: int) -> asyncio.Future[Any]:
        self.asked += 1
        going = asyncio.get_running_loop().create_future()
        going.set_exception(ActorUnavailableError("exiting", None))
        return going


async def test_a_start_no_watcher_took_fails_typed_and_retryable_with_the_order_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every watcher asked was going: the caller gets torpor's typed, retryable error (a
    503 problem at the edge, a retry in the outbox), not a bare ``RuntimeError``."""
    monkeypatch.setattr(ray_work, "MAX_ATTEMPTS", 3)
    exiting = ExitingWatcher()
    monkeypatch.setattr(ray_work, "create_named", made(exiting))
    order = an_order()
    runner = RayWorkRunner(Launch(Kind.TASK, fn=lambda args, ctx: None))
    runner.configure(Settings())
    runner._records = WorkRecords(MemoryObjectStore())
    with pytest.raises(WorkStartFailed) as raised:
        await runner.start(order)
    assert raised.value.retryable and raised.value.status == 503
    assert exiting.asked == 3
    saved = await runner.records.order(order.work_id)
    assert saved is not None and saved.work_id == order.work_id, "the order was lost"


async def test_a_start_retried_after_the_first_landed_late_starts_the_run_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start given up at its deadline reaches the watcher later and runs the work;
    the retry (the dispatch's) finds the same watcher by its name, and its ``start``
    starts nothing a second time."""
    monkeypatch.setattr(ray_work, "WATCHER_START_TIMEOUT_S", 0.1)
    order = an_order()
    launch = Launch(Kind.TASK, fn=lambda args, ctx: None)
    runner = RayWorkRunner(launch)
    runner.configure(Settings())
    runner._records = WorkRecords(MemoryObjectStore())
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )
    ran: list[int] = []

    async def main(run: int) -> None:
        ran.append(run)

    watcher._main = main
    late = LateWatcher(watcher)
    monkeypatch.setattr(ray_work, "create_named", made(late))
    async with asyncio.timeout(5):
        with pytest.raises(WorkStartUnanswered):
            await runner.start(order)
        late.release.set()  # the first start lands now, after its caller gave up
        while not ran:
            await asyncio.sleep(0.01)
        await runner.start(order)  # the retry
    assert late.asked == 2
    assert ran == [1], "the run was started twice"


class Tasks:
    """``ray.remote`` for the task executor: each task started fails as ``failure`` says."""

    def __init__(self, failure: BaseException) -> None:
        self.failure = failure
        self.started = 0

    def __call__(self, fn: Any) -> Tasks:
        return self

    def options(self, **options: Any) -> Tasks:
        return self

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        self.started += 1
        ended: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ended.set_exception(self.failure)
        return ended


def a_call() -> ToolContext:
    return ToolContext(
        session_id="s1",
        tenant="acme",
        step=1,
        tool_call_id="call_1",
        idempotency_key="k" * 32,
        trace_id="t",
        now=NOW,
        fence=1,
        variables={},
    )


async def test_a_task_call_that_died_of_a_ray_failure_is_not_joined_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call whose task died of a Ray failure (its worker crashed, killed for memory) is
    over: its ref is let go. It was kept for ever (one per such call in a long-lived
    process, the error pinned with it), and the same call again in that process (a
    retried activation on a pooled host) joined the dead ref and failed without running."""
    tasks = Tasks(WorkerCrashedError())
    monkeypatch.setattr(ray, "remote", tasks)
    executor = RayTaskExecutor()
    execution = TaskExecution(execution="task")
    for _ in range(2):
        with pytest.raises(WorkerCrashedError):
            await executor.run(lambda args, ctx: None, {}, a_call(), execution=execution)
    assert tasks.started == 2
    assert executor._inflight == {}


def gone(name: str, namespace: str | None = None) -> Any:
    raise ValueError(f"Failed to look up actor with name {name!r}")


async def test_an_actor_call_that_ray_could_not_make_is_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher could not make the actor call at all (Ray's control plane did not
    answer the actor's look-up): the call never started, so the policy runs it again.
    Nothing recorded why run 1 ended, and the poll took it for a call that may still run
    beside its lost watcher: the wait was answered ``work_lost`` and never run again."""
    order = an_order()
    launch = Launch(Kind.ACTOR, actor="model", method="embed")
    runner = await a_runner(launch, order)
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )

    def no_control_plane(name: str, namespace: str | None = None) -> Any:
        raise RaySystemError("the GCS did not answer")

    monkeypatch.setattr(ray, "get_actor", no_control_plane)
    with contextlib.suppress(Exception):  # as the watcher's main does: it logs and exits
        await watcher._execute(runner.records, 1)
    monkeypatch.setattr(ray, "get_actor", gone)  # the watcher has exited
    status = await runner.status(order.work_id)
    assert status.state is WorkState.LOST
    assert after_loss(RetryPolicy(max_runs=2), status) == Rerun(run=2), status


async def test_a_task_killed_for_memory_is_lost_with_its_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task Ray's memory monitor killed (or whose runtime_env could not be set up) is a
    lost run whose cause is on the record, so the wait's answer (after the policy's last
    run) says why. Neither is one of the losses the watcher caught: raised to its main,
    nothing was recorded, and the answer said "its node or process died"."""
    order = an_order()
    launch = Launch(Kind.TASK, fn=lambda args, ctx: None)
    runner = await a_runner(launch, order)
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )
    monkeypatch.setattr(ray, "remote", Tasks(OutOfMemoryError("killed: node low")))
    with contextlib.suppress(Exception):  # as the watcher's main does: it logs and exits
        await watcher._execute(runner.records, 1)
    monkeypatch.setattr(ray, "get_actor", gone)  # the watcher has exited
    status = await runner.status(order.work_id)
    assert status.state is WorkState.LOST
    assert "OutOfMemoryError" in (status.cause or ""), status


async def test_an_outcome_recorded_while_the_status_is_read_is_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher records its outcome and exits between the status's read of the outcome
    and its look for the watcher: the work is done, not lost. Taken for lost, an actor
    call's wait (or a last run's) was answered ``work_lost`` beside a real answer; if the
    watcher's own delivery had failed, ``work_lost`` was the only answer."""
    order = an_order()
    runner = await a_runner(Launch(Kind.ACTOR, actor="model", method="embed"), order)
    done: dict[str, JsonValue] = {"status": "ok", "result": {"vectors": 3}}

    async def finished_meanwhile(work: str) -> bool:
        await runner.records.record_outcome(work, done)  # recorded, then it exited
        return False

    monkeypatch.setattr(runner, "_alive", finished_meanwhile)
    status = await runner.status(order.work_id)
    assert (status.state, status.outcome) == (WorkState.DONE, done), status


class Deliveries:
    """``deliver`` as a list of what each attempt does: raise, or answer new/duplicate."""

    def __init__(self, *steps: BaseException | bool) -> None:
        self.steps = list(steps)
        self.calls = 0

    async def __call__(self, *args: Any) -> bool:
        self.calls += 1
        step = self.steps.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step


class Woken:
    sessions: ClassVar[list[str]] = []

    def __init__(self, *args: Any) -> None:
        pass

    async def activate_for_event(self, session_id: str) -> None:
        Woken.sessions.append(session_id)


class NoActivator:
    """Made for one delivery, closed after it; nothing to activate through."""

    closed = 0

    @classmethod
    async def made(cls, *args: Any, **kwargs: Any) -> NoActivator:
        return cls()

    async def close(self) -> None:
        NoActivator.closed += 1


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    Woken.sessions = []
    NoActivator.closed = 0
    monkeypatch.setattr(work_delivery, "SessionService", Woken)
    monkeypatch.setattr(work_delivery, "RayActivator", NoActivator)
    return Woken.sessions


async def test_an_outcome_whose_delivery_met_a_passing_fault_is_delivered_again(
    monkeypatch: pytest.MonkeyPatch, woken: list[str]
) -> None:
    """The index did not answer for a moment: the watcher gave up at once, and the answer
    waited for the reconciler's poll, at twice the work's expected duration."""
    order = an_order()
    attempts = Deliveries(StorageUnavailable("index down"), ConnectionResetError(), True)
    monkeypatch.setattr(work_delivery, "deliver", attempts)
    with fixed(0):
        await work_delivery.deliver_patiently(None, None, order, {"ok": True})  # type: ignore[arg-type]
    assert attempts.calls == 3 and woken == []


async def test_a_delivery_that_stored_the_event_before_it_failed_wakes_the_session(
    monkeypatch: pytest.MonkeyPatch, woken: list[str]
) -> None:
    order = an_order()
    attempts = Deliveries(StorageUnavailable("activation failed"), False)  # stored already
    monkeypatch.setattr(work_delivery, "deliver", attempts)
    with fixed(0):
        await work_delivery.deliver_patiently(None, None, order, {"ok": True})  # type: ignore[arg-type]
    assert attempts.calls == 2 and woken == [order.session_id]
    # Made for the one activation, closed after it: what it started behind the request
    # (a stalled pool channel's host check) ends with it, not when the watcher exits.
    assert NoActivator.closed == 1


async def test_a_delivery_refused_for_good_is_not_tried_again(
    monkeypatch: pytest.MonkeyPatch, woken: list[str]
) -> None:
    attempts = Deliveries(SessionNotFound("gone"), True)
    monkeypatch.setattr(work_delivery, "deliver", attempts)
    with fixed(0), pytest.raises(SessionNotFound):
        await work_delivery.deliver_patiently(None, None, an_order(), {"ok": True})  # type: ignore[arg-type]
    assert attempts.calls == 1


def test_a_jobs_log_is_read_from_its_end_and_kept_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_job_logs`` returned a job's whole log (gigabytes after hours of logging) to
    keep 2,000 characters: now the driver log's last lines are asked for, and however
    much comes back, no more than the tail is held."""
    asked: dict[str, Any] = {}

    def get_log(**options: Any) -> Any:
        asked.update(options)
        for i in range(10_000):
            yield f"line {i}\n"

    monkeypatch.setattr("ray.util.state.get_log", get_log)
    tail = work_jobs._logs_tail("job-1", "node-1")
    assert tail.endswith("line 9999\n") and len(tail) == work_jobs.LOGS_TAIL_CHARS
    assert asked["submission_id"] == "job-1" and asked["node_id"] == "node-1"
    assert 0 < asked["tail"] <= work_jobs.LOGS_TAIL_LINES


class Jobs:
    """A Jobs API client: the jobs it knows by submission id (each at its status), and the
    ones submitted or stopped through it. A job submitted through it has succeeded by the
    first look; every other stays as it is."""

    def __init__(self, **jobs: Any) -> None:
        self.jobs: dict[str, Any] = dict(jobs)
        self.submitted: list[str] = []
        self.stopped: list[str] = []
        self.errors: dict[str, str] = {}  # a failed job's error_type, by submission id
        self.submits_end: tuple[Any, str | None] = (JobStatus.SUCCEEDED, None)

    def _known(self, submission_id: str) -> Any:
        if submission_id not in self.jobs:
            raise RuntimeError(f"Request failed with status code 404: {submission_id}.")
        return self.jobs[submission_id]

    def get_job_info(self, submission_id: str) -> Any:
        status = self._known(submission_id)
        return SimpleNamespace(
            status=status,
            message=f"job {status}",
            driver_node_id=None,
            error_type=self.errors.get(submission_id),
        )

    def get_job_status(self, submission_id: str) -> Any:
        return self._known(submission_id)

    def submit_job(self, *, submission_id: str, **options: Any) -> str:
        self.submitted.append(submission_id)
        self.jobs[submission_id], error = self.submits_end
        if error is not None:
            self.errors[submission_id] = error
        return submission_id

    def stop_job(self, submission_id: str) -> bool:
        self.stopped.append(submission_id)
        return not self._known(submission_id).is_terminal()


async def a_job(monkeypatch: Any) -> tuple[WorkOrder, RayWorkRunner, Jobs, Any]:
    """A job's order, its runner, the Jobs API (knowing no job yet: a test adds them) and
    its watcher (the class itself, no actor) talking to that API."""
    order = an_order()
    launch = Launch(Kind.JOB, entrypoint=lambda args: "python train.py")
    runner = await a_runner(launch, order)
    jobs = Jobs()
    cls = WorkWatcher.__ray_metadata__.modified_class  # type: ignore[attr-defined]
    # The watcher's (its run) and the runner's (its stop without a watcher).
    patch_global(monkeypatch, cls, work_watcher, "_job_client", lambda launch: jobs)
    monkeypatch.setattr(ray_work, "_job_client", lambda launch: jobs)
    patch_global(monkeypatch, cls, work_watcher, "_logs_tail", lambda submission_id, node_id: "")
    watcher = cls(ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch)
    return order, runner, jobs, watcher


@pytest.mark.parametrize("ended", [JobStatus.FAILED, JobStatus.STOPPED, JobStatus.SUCCEEDED])
async def test_a_job_that_ended_before_its_watcher_was_lost_is_answered_not_submitted_again(
    ended: JobStatus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run 1's job ended on its own (its entrypoint exited non-zero, an operator stopped
    it) and its watcher was lost before recording it: run 2 answers with that job's end.
    Only a running or succeeded job was adopted; a failed or stopped one was submitted
    again as run 2's, and the job ran twice."""
    order, runner, jobs, watcher = await a_job(monkeypatch)
    jobs.jobs[f"{order.work_id}-1"] = ended
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    outcome = await watcher._execute(runner.records, 2)
    assert jobs.submitted == []
    assert outcome is not None and outcome["status"] == ("ok" if ended == "SUCCEEDED" else "error")
    if ended is not JobStatus.STOPPED:  # stopped outside torpor: answered as such
        assert outcome[("result" if ended == "SUCCEEDED" else "error")] == {
            "submission_id": f"{order.work_id}-1",
            "status": str(ended.value),
            "message": f"job {ended}",
            "logs_tail": "",
        }


async def test_a_job_ray_never_heard_of_is_submitted_for_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run 1's job was never submitted (its watcher was lost first): run 2 submits its own."""
    order, runner, jobs, watcher = await a_job(monkeypatch)
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    outcome = await watcher._execute(runner.records, 2)
    assert jobs.submitted == [f"{order.work_id}-2"]
    assert outcome is not None and outcome["status"] == "ok"


async def test_a_job_the_dashboard_failed_to_look_up_is_not_submitted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dashboard failed to answer for run 1's job (a 500, not "no such job"): it may
    run, so run 2 submits nothing and is lost (the next run looks again). Every failed
    look-up was read as "never submitted", and a running job was submitted again."""
    order, runner, jobs, watcher = await a_job(monkeypatch)

    def dashboard_failed(submission_id: str) -> Any:
        raise RuntimeError("Request failed with status code 500: internal error.")

    monkeypatch.setattr(jobs, "get_job_info", dashboard_failed)
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    with pytest.raises(RuntimeError, match="500"):
        await watcher._execute(runner.records, 2)
    assert jobs.submitted == []


class Model:
    """A named actor whose method's call ends as ``failure`` says, and whose look-ups
    after that call find it, or (``dead``) find no actor by its name."""

    def __init__(self, failure: BaseException, *, dead: bool = False) -> None:
        self.embed = self
        self.failure = failure
        self.dead = dead
        self.calls = 0

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        self.calls += 1
        ended: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        ended.set_exception(self.failure)
        return ended

    def look_up(self, name: str, namespace: str | None = None) -> Any:
        if self.calls and self.dead:
            return gone(name, namespace)
        return self


async def a_lost_actor_call(model: Model, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run 1 of an actor call whose call ends as ``model`` says; the status once its
    watcher has exited."""
    order = an_order()
    launch = Launch(Kind.ACTOR, actor="model", method="embed")
    runner = await a_runner(launch, order)
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )
    monkeypatch.setattr(ray, "get_actor", model.look_up)
    assert await watcher._execute(runner.records, 1) is None
    assert model.calls == 1
    monkeypatch.setattr(ray, "get_actor", gone)  # the watcher has exited
    return await runner.status(order.work_id)


async def test_an_actor_call_cut_off_by_an_unreachable_actor_is_not_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The actor could not be reached for a moment (``ActorUnavailableError``) and is
    still there: the call may still run in it, so the policy does not call it again
    beside itself. It was read as a lost process, and run 2 called the actor anew."""
    unavailable = ActorUnavailableError("the actor is temporarily unavailable", None)
    status = await a_lost_actor_call(Model(unavailable), monkeypatch)
    assert status.state is WorkState.LOST
    assert not status.rerunnable, status
    assert isinstance(after_loss(RetryPolicy(max_runs=2), status), Fail), status


async def test_an_actor_call_whose_actor_is_known_dead_is_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unreachable, then no actor by its name: its process is gone, and the call with it."""
    unavailable = ActorUnavailableError("the actor is temporarily unavailable", None)
    status = await a_lost_actor_call(Model(unavailable, dead=True), monkeypatch)
    assert status.state is WorkState.LOST
    assert after_loss(RetryPolicy(max_runs=2), status) == Rerun(run=2), status


def unreachable_dashboard(submission_id: str) -> Any:
    raise requests.ConnectionError("Failed to establish a new connection: refused")


def agent_gone(submission_id: str) -> Any:
    # The dashboard's answer when the agent that ran a job is gone with it (it finished).
    raise RuntimeError("Request failed with status code 500: No available agent.")


async def test_a_stop_of_a_job_that_ended_already_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job ended while its stop was asked for, and the dashboard refused the stop (its
    agent went with the job): the work is stopped all the same. The refusal came back
    to the cancel as a raw error."""
    order, _runner, jobs, watcher = await a_job(monkeypatch)
    jobs.jobs[f"{order.work_id}-1"] = JobStatus.FAILED
    monkeypatch.setattr(jobs, "stop_job", agent_gone)
    watcher._job = f"{order.work_id}-1"
    await watcher.stop()


@pytest.mark.parametrize("failure", [unreachable_dashboard, agent_gone], ids=["unreachable", "500"])
async def test_a_stop_the_dashboard_did_not_take_is_a_retryable_torpor_error(
    failure: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job still runs (or nothing says it ended) and its stop failed: the stop raises
    ``WorkStopFailed``, retryable, so the compensation asks again. It raised the
    client's own ``ConnectionError``/``RuntimeError``, which nothing retries."""
    order, runner, jobs, watcher = await a_job(monkeypatch)
    jobs.jobs[f"{order.work_id}-1"] = JobStatus.RUNNING
    monkeypatch.setattr(jobs, "stop_job", failure)
    watcher._job = f"{order.work_id}-1"
    with pytest.raises(WorkStopFailed) as raised:
        await watcher.stop()
    assert raised.value.retryable
    # With no watcher, the runner stops each run's job itself, and fails alike.
    monkeypatch.setattr(ray, "get_actor", gone)
    with pytest.raises(WorkStopFailed):
        await runner.stop(order.work_id, reason="cancelled")


class StoppingWatcher:
    """A watcher handle whose ``stop`` fails in the actor with ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        self.stop = self
        self.cause = cause

    def remote(self) -> asyncio.Future[None]:
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ended.set_exception(RayTaskError("stop", "Traceback ...", self.cause))
        return ended


async def test_a_watchers_failed_stop_reaches_the_caller_as_a_torpor_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher's stop failed in the actor: the runner's caller got Ray's wrapper,
    ``RayTaskError``; now a ``WorkStopFailed``."""
    order = an_order()
    runner = await a_runner(Launch(Kind.JOB, entrypoint=lambda args: "true"), order)
    handle = StoppingWatcher(WorkStopFailed("its job's stop failed"))
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: handle)
    with pytest.raises(WorkStopFailed) as raised:
        await runner.stop(order.work_id, reason="cancelled")
    assert raised.value.retryable


def gcs_silent(name: str, namespace: str | None = None) -> Any:
    # What ``ray.get_actor`` raises once the GCS has not answered within Ray's deadline.
    raise GetTimeoutError(
        "There was timeout in getting the actor handle, probably because the GCS server "
        "is dead or under high load ."
    )


class UnstoppableWatcher:
    """A watcher handle whose ``stop`` fails as ``answer`` says (``Watcher``'s answers)."""

    def __init__(self, answer: Any) -> None:
        self.stop = Watcher(answer)


@pytest.mark.parametrize(
    "lookup",
    [
        gcs_silent,
        lambda name, namespace=None: UnstoppableWatcher(unreachable),
        lambda name, namespace=None: UnstoppableWatcher(silent),
    ],
    ids=["gcs_timeout", "unavailable", "no_answer"],
)
async def test_a_stop_that_did_not_reach_a_tasks_watcher_is_a_retryable_torpor_error(
    lookup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GCS did not answer the watcher's lookup, or the watcher did not take the stop:
    it was read as "no watcher" (a task dies with it), and the stop reported done while
    the task ran on. Not known gone, as ``status`` reads it: ``WorkStopFailed``, which
    the compensation asks again."""
    monkeypatch.setattr(ray_work, "STATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray, "get_actor", lookup)
    order = an_order()
    runner = await a_runner(Launch(Kind.TASK, fn=lambda args, ctx: None), order)
    with pytest.raises(WorkStopFailed) as raised:
        await runner.stop(order.work_id, reason="cancelled")
    assert raised.value.retryable
    assert await runner.records.stopped(order.work_id)  # no later dispatch starts it


async def test_a_stop_of_a_task_whose_watcher_is_gone_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No watcher by its name: its task died with it, and there is nothing left to stop."""
    monkeypatch.setattr(ray, "get_actor", gone)
    order = an_order()
    runner = await a_runner(Launch(Kind.TASK, fn=lambda args, ctx: None), order)
    await runner.stop(order.work_id, reason="cancelled")
    assert await runner.records.stopped(order.work_id)


class Reports:
    """A watcher handle that keeps the progress reports sent to it."""

    def __init__(self) -> None:
        self.progress = self
        self.sent: list[tuple[float, str]] = []

    def remote(self, fraction: float, message: str) -> None:
        self.sent.append((fraction, message))


@pytest.mark.parametrize("lookup", [gcs_silent, gone], ids=["gcs_timeout", "no_watcher"])
def test_a_progress_report_whose_watcher_cannot_be_looked_up_is_lost_not_the_work(
    lookup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work function's report looked its watcher up and let the lookup's error out
    (the GCS not answering within Ray's deadline, the name not found): the work failed
    with it, answered ``work_error`` for good over an advisory report. That report is
    lost; the next one looks the watcher up again."""
    watcher = Reports()
    lookups = iter([lookup, lambda name, namespace=None: watcher])
    monkeypatch.setattr(
        ray, "get_actor", lambda name, namespace=None: next(lookups)(name, namespace)
    )
    ctx = WorkContext(
        session_id="s1",
        tenant="acme",
        work_id="w1",
        tool_name="embed",
        idempotency_key="k",
        run=1,
        namespace="t",
    )
    ctx.progress(0.25, "a quarter")
    ctx.progress(0.5, "half")
    assert watcher.sent == [(0.5, "half")]


async def test_a_long_jobs_watcher_asks_about_it_less_and_less_up_to_a_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A watcher asked the dashboard about its job every 0.5 s for the job's whole life:
    100 hour-long jobs were 200 requests a second to one dashboard. Now the first look
    still comes 0.5 s after the submit (a quick job is seen quickly), the period grows,
    and an hour-long job is asked about a few hundred times, at most every 15 s."""
    _order, runner, jobs, watcher = await a_job(monkeypatch)
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def clock(delay: float) -> None:  # time passes as the watcher waits, at once
        slept.append(delay)
        await real_sleep(0)

    def status(submission_id: str) -> JobStatus:
        return JobStatus.RUNNING if sum(slept) < 3600 else JobStatus.SUCCEEDED

    monkeypatch.setattr(ray_work.asyncio, "sleep", clock)
    monkeypatch.setattr(jobs, "get_job_status", status)
    with fixed():
        outcome = await watcher._execute(runner.records, 1)
    assert outcome is not None and outcome["status"] == "ok"
    assert slept[0] == 0.5
    assert slept == sorted(slept) and 10 <= max(slept) <= 15, slept
    assert len(slept) <= 3600 / 10, len(slept)


async def test_a_job_ray_lost_with_its_node_is_a_lost_run_not_the_works_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job's supervisor died (its node went): FAILED, with no answer of the work's
    own. Answered as the work's failure, a job the infrastructure lost was never run
    again; it is a lost run now, which the retry policy may run again."""
    order, runner, jobs, watcher = await a_job(monkeypatch)
    jobs.submits_end = (JobStatus.FAILED, "JOB_SUPERVISOR_ACTOR_DIED")
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    assert await watcher._execute(runner.records, 2) is None
    cause = await runner.records.lost_cause(order.work_id, 2)
    assert cause is not None and "JOB_SUPERVISOR_ACTOR_DIED" in cause


async def test_a_job_ray_lost_is_not_adopted_by_the_next_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run 1's job was lost by Ray: run 2 submits its own rather than answer with the
    dead one's failure (or record itself lost on it, at every run, to the last)."""
    order, runner, jobs, watcher = await a_job(monkeypatch)
    jobs.jobs[f"{order.work_id}-1"] = JobStatus.FAILED
    jobs.errors[f"{order.work_id}-1"] = "JOB_SUPERVISOR_ACTOR_DIED"
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    outcome = await watcher._execute(runner.records, 2)
    assert jobs.submitted == [f"{order.work_id}-2"]
    assert outcome is not None and outcome["status"] == "ok"


async def test_a_job_whose_entrypoint_failed_is_the_works_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order, runner, jobs, watcher = await a_job(monkeypatch)
    jobs.submits_end = (JobStatus.FAILED, "JOB_ENTRYPOINT_COMMAND_ERROR")
    assert await runner.records.claim_run(order.work_id, 2, by="watcher")
    outcome = await watcher._execute(runner.records, 2)
    assert outcome is not None and outcome["status"] == "error"
