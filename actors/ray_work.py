"""Compute work on Ray as a tool (``torpor.work``): a task, an actor method or a Job.

Each work is watched by one detached named actor, ``work:{work id}`` in the deployment's
namespace, where the work id is a digest of the business key ``tenant:action_key:epoch``.
The name is the lookup: a re-dispatch after a crash finds the watcher that is already
running and changes nothing. Past the name, the create-only records of
``storage.work`` decide: a run is started only by the process that claims its number, an
outcome once recorded is the answer for good, a stopped work is never started again.

The watcher costs no CPU (``num_cpus=0``): it starts the work with the declared
resources (a task with ``resources={"gpu_node": 1}`` lands on such a node), awaits it,
records the outcome, writes it into the session's inbox and asks for an activation: the
same path a webhook takes after its inbox write. Then it exits. A run whose process or
node dies is recorded as lost; the reconciler's ``poll`` finds it and the tool's retry
policy decides. Nothing here polls in the normal case.

:class:`RayTaskExecutor` runs a sync tool's call as a Ray task instead of inline
(``execution = "task"``): named by the call's ``H(session:step:call)`` key and joined
while in flight, so the loop only awaits its result.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import ray
from pydantic import JsonValue
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    AsyncioActorExit,
    GetTimeoutError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    RayActorError,
    RayError,
    RayTaskError,
    TaskCancelledError,
    WorkerCrashedError,
)

from actors.config_ref import ConfigRef
from actors.named import create_named, get_actor
from actors.ray_activator import RayActivator
from actors.wiring import open_services
from storage.factory import open_object_store
from storage.work import ObjectProgress, WorkRecords
from torpor.backoff import Backoff
from torpor.errors import WorkStartUnanswered, WorkStopFailed
from torpor.events import EventKind, InboxEvent
from torpor.faults import crash_point
from torpor.ports import ObjectStore
from torpor.service.sessions import SessionService
from torpor.settings import Settings
from torpor.tools import ToolContext, ToolSpec
from torpor.transient import transient
from torpor.work import (
    INLINE_RESULT_BYTES,
    WORK_SOURCE,
    ExecutedTool,
    Progress,
    Resources,
    RetryPolicy,
    TaskExecution,
    WorkOrder,
    WorkState,
    WorkStatus,
    WorkTool,
    event_type,
    outcome_data,
)

log = logging.getLogger(__name__)

ACCEPTED = "accepted"
CLOSING = "closing"
# A run's process or node is gone: the run is lost (the retry policy decides), not failed.
# ``ActorUnavailableError`` is a ``RayActorError`` too, but it proves no death: it is
# caught before these (``_execute``).
_LOST = (
    WorkerCrashedError,
    NodeDiedError,
    ObjectLostError,
    OwnerDiedError,
    LocalRayletDiedError,
    ActorDiedError,
    RayActorError,
)
_GONE = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError, ValueError)
MAX_ATTEMPTS = 40
STATE_TIMEOUT_S = 5.0
# A watcher's ``start`` answers at once once its process runs; the first call to a new
# one also waits for that process to start (seconds on a busy node, where Ray starts a
# few workers at a time). Shorter than a dispatch's own deadline (the tool's, else 60 s),
# so its caller sees why, typed and retryable (``WorkStartUnanswered``).
WATCHER_START_TIMEOUT_S = 30.0
# How long a watcher waits between its looks at its own job (no reconciler): 0.5 s at
# first, so a quick job is seen quickly, then longer, to 15 s (±10%). A fixed 0.5 s for each
# job's whole life was 200 requests a second to one dashboard for 100 long jobs. The
# jitter keeps the watchers of jobs submitted together from asking in step.
JOB_STATUS_BACKOFF = Backoff(base_s=0.5, cap_s=15.0, factor=1.5, jitter=0.1)
SUBMIT_ATTEMPTS = 12  # about 45 s for a cluster's job agents to come up
# Each request to the Jobs API (connect, then each read); a submit that uploads a
# working directory streams it in reads of its own, so this bounds silence, not size.
JOB_CALL_TIMEOUT_S = 30.0
# The lost cause a watcher records for a run claimed by a watcher that is gone: what that
# one started is not known to have ended (an actor's method may still run, ``status``).
WATCHER_GONE = "the process running it is gone"
# The lost cause of an actor call cut off by an actor that could not be reached, and was
# still there after: the call's answer is lost, but the call may still run in it.
CALL_CUT_OFF = "its actor could not be reached"


def watcher_name(work_id: str) -> str:
    return f"work:{work_id}"


class Kind(StrEnum):
    TASK = "task"
    ACTOR = "actor"
    JOB = "job"


@dataclass(frozen=True)
class Launch:
    """How a run is started: pickled to the watcher with the order."""

    kind: Kind
    resources: Resources = field(default_factory=Resources)
    fn: Any = None  # TASK: fn(args, ctx) -> JSON
    actor: str | None = None  # ACTOR: a named actor, and the method to call on it
    actor_namespace: str | None = None
    method: str | None = None
    entrypoint: Any = None  # JOB: fn(args) -> shell command
    job_address: str | None = None  # JOB: the dashboard (None: this cluster's)


@dataclass
class WorkContext:
    """What the work function is given: who it works for, and a way to report progress."""

    session_id: str
    tenant: str
    work_id: str
    tool_name: str
    idempotency_key: str
    run: int
    namespace: str
    _watcher: Any = None

    def progress(self, fraction: float, message: str = "") -> None:
        """Report progress: shown in the session's view and stream, wakes nothing.
        Fire and forget: a lost report is replaced by the next one. The watcher hands
        its own handle in the context, so a report asks the GCS nothing: looked up by
        name in the work function, a slow GCS held the caller (an async actor's whole
        loop, for an actor's method) for up to Ray's 60 s. A context without it looks
        the watcher up; one that cannot be looked up now (the GCS did not answer within
        Ray's deadline, or the watcher is gone) loses this report and is looked up
        again at the next: the lookup's error reached the work function, and a report,
        advisory, failed the work for good (``work_error``)."""
        if self._watcher is None:
            try:
                self._watcher = ray.get_actor(watcher_name(self.work_id), namespace=self.namespace)
            except (RayError, ValueError):  # ValueError: no actor by that name
                log.warning("work %s: its progress report is lost", self.work_id, exc_info=True)
                return
        self._watcher.progress.remote(max(0.0, min(1.0, float(fraction))), str(message)[:500])


def _own_handle() -> Any:
    """The calling actor's own handle (no GCS call), or None outside an actor."""
    if not ray.is_initialized():  # a test driving the class: asked, Ray would start one
        return None
    try:
        return ray.get_runtime_context().current_actor
    except (RuntimeError, RayError):  # not in an actor
        return None


def _run_task(fn: Callable[..., Any], args: dict[str, Any], ctx: WorkContext) -> Any:
    return fn(args, ctx)


# --- the watcher ------------------------------------------------------------------------


@ray.remote(num_cpus=0, max_restarts=0)
class WorkWatcher:
    def __init__(self, config: ConfigRef, order: dict[str, Any], launch: Launch) -> None:
        self._settings = config.load()
        self._config = config
        self._order = WorkOrder.from_data(order)
        self._launch = launch
        self._task: asyncio.Task[None] | None = None
        self._ref: Any = None
        self._job: str | None = None
        self._closing = False
        self._stopping = False
        self._store: ObjectStore | None = None
        # Progress reports being written; the clearing at the end waits for them, so a
        # report that arrives as the work ends (its last act, say) never lands after it.
        self._writing: set[asyncio.Future[None]] = set()
        self._ended = False

    async def start(self, run: int) -> str:
        if self._closing:
            return CLOSING
        if self._task is None:
            self._task = asyncio.create_task(self._main(run))
        return ACCEPTED

    async def state(self) -> dict[str, Any]:
        return {"running": not self._closing, "pid": os.getpid()}

    async def progress(self, fraction: float, message: str) -> None:
        order = self._order
        report = Progress(
            work_id=order.work_id,
            tool_name=order.tool_name,
            fraction=fraction,
            message=message,
            at=datetime.now(UTC),
        )
        store = self._store
        if store is None or self._closing or self._ended:
            return
        # Written side by side (a chatty work reports often; one at a time they would
        # queue behind each other and hold up the clearing, and the calls' slots).
        writing = asyncio.ensure_future(ObjectProgress(store).report(order.session_id, report))
        self._writing.add(writing)
        try:
            with contextlib.suppress(Exception):  # advisory: never fails the work
                await writing
        finally:
            self._writing.discard(writing)

    async def _clear_progress(self, store: ObjectStore) -> None:
        """The work is over (answered, or stopped with its session): its progress goes,
        after the reports already being written, and no report coming later is kept."""
        self._ended = True
        await asyncio.gather(*self._writing, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ObjectProgress(store).clear(self._order.session_id, self._order.work_id)

    async def stop(self) -> None:
        self._stopping = True
        if self._ref is not None:
            ray.cancel(self._ref, force=self._launch.kind is Kind.TASK)
        if self._job is not None:
            await _stop_job(_job_client(self._launch), self._job)

    async def _main(self, run: int) -> None:
        services = open_services(self._settings)
        self._store = services.store
        records = WorkRecords(services.store)
        work = self._order.work_id
        try:
            outcome = await records.outcome(work)
            if outcome is None and not await records.stopped(work):
                if await records.claim_run(work, run, by=f"{os.getpid()}"):
                    outcome = await self._execute(records, run)
                else:
                    # The run was claimed by a watcher that is gone (this one holds the
                    # name now): whatever it ran is lost; the retry policy decides.
                    await records.record_lost(work, run, WATCHER_GONE)
            if outcome is not None and not self._stopping:
                outcome = await records.record_outcome(work, outcome)
                crash_point("work.outcome_recorded")
                await self._clear_progress(services.store)
                await deliver_patiently(services, self._config, self._order, outcome)
            elif self._stopping:
                await self._clear_progress(services.store)
        except Exception:
            log.exception("work %s failed in its watcher", work)
        finally:
            self._closing = True
            with contextlib.suppress(Exception):
                await services.close()
            with contextlib.suppress(AsyncioActorExit):
                ray.actor.exit_actor()  # type: ignore[no-untyped-call]

    async def _execute(self, records: WorkRecords, run: int) -> dict[str, JsonValue] | None:
        order, launch = self._order, self._launch
        ctx = WorkContext(
            session_id=order.session_id,
            tenant=order.tenant,
            work_id=order.work_id,
            tool_name=order.tool_name,
            idempotency_key=order.idempotency_key,
            run=run,
            namespace=self._settings.namespace,
            _watcher=_own_handle(),
        )
        if self._stopping:
            # Stopped while this run was being claimed (``stop`` found nothing started
            # yet to cancel): nothing is started now.
            return None
        try:
            if launch.kind is Kind.JOB:
                return await self._job_run(records, run)
            try:
                self._ref = await self._launched(ctx, run)
                if self._ref is None:
                    return None  # stopped while its actor was looked up: nothing started
            except (ValueError, AttributeError, TypeError) as exc:
                # No such actor (ValueError) or method, options Ray refuses: another run
                # would meet them again.
                return _failed("work_not_started", "the work could not be started", exc)
            except Exception as exc:
                # Anything else (Ray's control plane unavailable, ``ClusterUnavailable``
                # from the actor's lookup): the run is lost, and the
                # policy may run it again. Its cause is recorded: with none, an actor call
                # that never started read as one that may still run, and was never rerun.
                why = f"not started: {type(exc).__name__}: {exc}"[:1000]
                await records.record_lost(order.work_id, run, why)
                return None
            value = await self._ref
        except TaskCancelledError:
            if self._stopping or await records.stopped(order.work_id):
                return None
            return _stopped_elsewhere("its task was cancelled")
        except ActorUnavailableError as exc:
            # The actor was unreachable (a network blip, a node under load): the call may
            # have reached it and still run there. Unless the actor is known dead, the
            # run is recorded as one that may still run, which the policy never runs
            # again beside itself; read as lost, run 2 called the actor a second time.
            if self._stopping:
                return None
            cut_off = launch.kind is Kind.ACTOR and not await _actor_dead(launch)
            why = CALL_CUT_OFF if cut_off else f"{type(exc).__name__}: {exc}"[:1000]
            await records.record_lost(order.work_id, run, why)
            return None
        except RayTaskError as exc:  # the work's own exception: its answer
            if self._stopping:
                return None
            cause = exc.cause if exc.cause is not None else exc
            return outcome_data(
                ok=False,
                value={"code": "work_error", "message": f"{type(cause).__name__}: {cause}"[:1000]},
            )
        except (*_LOST, RayError) as exc:
            # Every other Ray failure too (a task its node's memory monitor killed, a
            # runtime_env that could not be set up): lost with its cause on the record.
            if self._stopping:
                return None
            await records.record_lost(order.work_id, run, f"{type(exc).__name__}: {exc}"[:1000])
            return None
        return await self._answer(records, value)

    async def _launched(self, ctx: WorkContext, run: int) -> Any:
        """Start the run (a task, or the call of an actor's method): its object ref."""
        order, launch = self._order, self._launch
        if launch.kind is Kind.ACTOR:
            handle = await get_actor(str(launch.actor), launch.actor_namespace)
            if self._stopping:
                # ``stop`` ran during the lookup, found nothing started to cancel, and
                # reported the work stopped: called now, the method would run its side
                # effects unseen (its outcome dropped as stopped).
                return None
            return getattr(handle, str(launch.method)).remote(dict(order.request), ctx)
        options = {**launch.resources.ray_options(), "max_retries": 0}
        options["name"] = f"work:{order.work_id}:{run}"
        return ray.remote(_run_task).options(**options).remote(launch.fn, order.request, ctx)

    async def _answer(self, records: WorkRecords, value: Any) -> dict[str, JsonValue]:
        try:
            raw = json.dumps(value, default=str).encode()
        except (TypeError, ValueError) as exc:  # a key that is no string, a cycle...
            # Deterministic: a run again would finish the same way, and be lost again.
            return _failed("work_result_invalid", "the work's result is not JSON", exc)
        if len(raw) <= INLINE_RESULT_BYTES:
            return outcome_data(ok=True, value=json.loads(raw))
        # Too large for a snapshot: stored beside it, passed by reference.
        key = await records.put_result(self._order.work_id, raw)
        return {"status": "ok", "result_ref": {"key": key, "bytes": len(raw)}}

    async def _job_run(self, records: WorkRecords, run: int) -> dict[str, JsonValue] | None:
        from ray.job_submission import JobStatus

        client = _job_client(self._launch)
        try:
            entrypoint = self._launch.entrypoint(dict(self._order.request))
        except Exception as exc:  # the tool's own bug: every run would fail alike
            return _failed("work_not_started", "the job's entrypoint could not be made", exc)
        # Named by the key: looked up first, submitted only if it is not there.
        adopted = await self._running_job(client, run)
        submission_id = adopted or f"{self._order.work_id}-{run}"
        if self._stopping:  # stopped while it looked: nothing is submitted now
            if adopted is not None:
                await _stop_job(client, adopted)
            return None
        self._job = submission_id
        if adopted is None:
            refused = await self._submit(client, submission_id, entrypoint)
            if refused is not None:
                return _failed("work_not_started", "the job was refused", refused)
            if self._stopping:  # stopped while it was submitted: ``stop`` found no job
                await _stop_job(client, submission_id)
        looks = 0
        while True:
            # One request under the client's deadline (``JOB_CALL_TIMEOUT_S``).
            status = await asyncio.to_thread(client.get_job_status, submission_id)
            if status.is_terminal():
                break
            await asyncio.sleep(JOB_STATUS_BACKOFF.delay_s(looks))
            looks += 1
        if status is JobStatus.STOPPED:
            if self._stopping or await records.stopped(self._order.work_id):
                return None
            # ``ray job stop`` by someone else: the answer, not a loss to run again.
            return _stopped_elsewhere(f"its job {submission_id} was stopped")
        info = await asyncio.to_thread(client.get_job_info, submission_id)
        if status is JobStatus.FAILED and _lost_to_ray(info):
            # Ray lost the job (its supervisor died with its node, or it never started):
            # no answer of the work's own, so the run is lost and the policy may run it
            # again, under a new submission id; the dead job is never adopted again.
            why = f"its job {submission_id} was lost: {info.error_type}: {info.message}"
            await records.record_lost(self._order.work_id, run, why[:1000])
            return None
        value: dict[str, JsonValue] = {
            "submission_id": submission_id,
            "status": str(status.value),
            "message": str(info.message or ""),
            "logs_tail": await asyncio.to_thread(
                _logs_tail, submission_id, getattr(info, "driver_node_id", None)
            ),
        }
        return outcome_data(ok=status is JobStatus.SUCCEEDED, value=value)

    async def _running_job(self, client: Any, run: int) -> str | None:
        """This run's job, or the latest earlier run's job Ray knows, whatever its status:
        a job outlives its watcher, so a run after a lost watcher adopts it and answers
        with its end. A job that failed or was stopped on its own ended; submitted
        again, it ran twice. Only a run whose job Ray never had is submitted anew."""
        for earlier in range(run, 0, -1):
            submission_id = f"{self._order.work_id}-{earlier}"
            try:
                info = await asyncio.to_thread(client.get_job_info, submission_id)
            except RuntimeError as exc:
                if not _no_such_job(exc):
                    # The dashboard failed (not "no such job"): the job may be there, so
                    # nothing is submitted; the run is lost and the next one looks again.
                    raise
                continue
            if _lost_to_ray(info):
                continue  # dead without an answer of its own: its run was lost (_job_run)
            return submission_id
        return None

    async def _submit(
        self, client: Any, submission_id: str, entrypoint: str
    ) -> RuntimeError | None:
        """Submit under ``submission_id``; a cluster whose job agents are still starting
        answers "try again later", so it is asked again for a while. The refusal when
        the job itself is refused (a runtime_env or resources it cannot have)."""
        resources, order = self._launch.resources, self._order
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                await asyncio.to_thread(
                    client.submit_job,
                    entrypoint=entrypoint,
                    submission_id=submission_id,
                    runtime_env=resources.runtime_env,
                    entrypoint_num_cpus=resources.num_cpus,
                    entrypoint_num_gpus=resources.num_gpus,
                    entrypoint_memory=resources.memory or 0,
                    entrypoint_resources=dict(resources.resources) or None,
                    metadata={"torpor_session": order.session_id},
                )
                return None
            except RuntimeError as exc:
                if "already exists" in str(exc):
                    return None  # a submit whose answer was lost went through after all
                if "status code 400" in str(exc):
                    return exc  # an invalid request (the dashboard's 400): refused for good
                if "try again" not in str(exc) or attempt + 1 == SUBMIT_ATTEMPTS:
                    raise  # the dashboard failed, or its agents never came up: lost
            await asyncio.sleep(min(5.0, 0.5 * 2**attempt))
        return None  # pragma: no cover - the loop returns or raises


async def _actor_dead(launch: Launch) -> bool:
    """True only when no actor answers to the launch's name any more (a dead actor's name
    is let go): an actor Ray cannot look up right now (in time, too) is not known dead."""
    try:
        await get_actor(str(launch.actor), launch.actor_namespace)
    except ValueError:
        return True
    except Exception:
        return False
    return False


async def _stop_job(client: Any, submission_id: str) -> None:
    """Stop a job. One never submitted, or over already (the dashboard may refuse to stop
    it: its agent went with it), is stopped; any other failure is ``WorkStopFailed``:
    it may still run, and the caller asks again."""
    try:
        await asyncio.to_thread(client.stop_job, submission_id)
        return
    except RuntimeError as exc:  # the client's every refused request
        if _no_such_job(exc):
            return
        failure: Exception = exc
    except OSError as exc:  # requests' own: no connection, no answer in time
        failure = exc
    try:
        status = await asyncio.to_thread(client.get_job_status, submission_id)
    except (RuntimeError, OSError):
        status = None  # not known to have ended: the stop's failure stands
    if status is not None and status.is_terminal():
        return
    raise WorkStopFailed(
        f"job {submission_id} could not be stopped: {type(failure).__name__}: {failure}"[:1000]
    ) from failure


# How Ray says it lost a job rather than the job failing on its own: its supervisor died
# (with its node) or the job never started. Not a runtime_env that could not be set up,
# nor the entrypoint's own error: a run again would meet those again.
_LOST_JOB_ERRORS = frozenset(
    {
        "JOB_SUPERVISOR_ACTOR_DIED",
        "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
        "JOB_SUPERVISOR_ACTOR_START_FAILURE",
        "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE",
    }
)


def _lost_to_ray(info: Any) -> bool:
    """Whether a FAILED job's info says Ray lost it (``_LOST_JOB_ERRORS``)."""
    from ray.job_submission import JobStatus

    error = getattr(info, "error_type", None)
    name = str(getattr(error, "value", error) or "")
    return getattr(info, "status", None) is JobStatus.FAILED and name in _LOST_JOB_ERRORS


def _no_such_job(exc: RuntimeError) -> bool:
    """The Jobs API's answer for a submission id it never had (its client raises every
    failed request as a ``RuntimeError`` carrying the status code)."""
    return "status code 404" in str(exc)


def _failed(code: str, what: str, exc: BaseException) -> dict[str, JsonValue]:
    """The answer to a run that failed for a reason another run would meet again."""
    return outcome_data(
        ok=False, value={"code": code, "message": f"{what}: {type(exc).__name__}: {exc}"[:1000]}
    )


def _stopped_elsewhere(what: str) -> dict[str, JsonValue]:
    """Stopped by someone other than torpor (an operator): answered, not run again."""
    return outcome_data(
        ok=False, value={"code": "work_stopped", "message": f"{what} outside torpor"}
    )


def _job_client(launch: Launch) -> Any:
    """A Jobs API client whose every request has a deadline (``JOB_CALL_TIMEOUT_S``)."""
    address = launch.job_address or _dashboard_url()
    return _deadline_client()(address)


@functools.cache
def _deadline_client() -> type:
    """Ray's ``JobSubmissionClient`` sends its requests with no timeout: a dashboard that
    accepts and never answers held the watcher's status poll (and a thread) for ever,
    and the session waited on a job nobody watched until its SLA. Each request now
    fails after the deadline; the watcher's run is then lost, and the next run adopts
    the job still running (``_running_job``)."""
    from ray.job_submission import JobSubmissionClient

    class DeadlineJobClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", JOB_CALL_TIMEOUT_S)
            return super()._do_request(method, endpoint, **kwargs)

    return DeadlineJobClient


def _dashboard_url() -> str:
    from ray._private.services import get_webui_url_from_internal_kv
    from ray._private.worker import get_dashboard_url

    # The address the dashboard registered in the cluster's KV: a worker's own view
    # (``get_dashboard_url``) assumes the default port even when the dashboard is elsewhere.
    url = get_webui_url_from_internal_kv() or get_dashboard_url()  # type: ignore[no-untyped-call]
    return str(url) if str(url).startswith("http") else f"http://{url}"


LOGS_TAIL_CHARS = 2000
LOGS_TAIL_LINES = 200


def _logs_tail(submission_id: str, node_id: str | None) -> str:
    """The end of a job's driver log, read from its end: ``get_job_logs`` returned the
    whole log, and a job that ran for hours logging gigabytes took the watcher's memory
    (it declares none) to keep 2,000 characters of it."""
    from ray.util.state import get_log  # only a job's end needs the state API

    tail = ""
    try:
        for chunk in get_log(
            submission_id=submission_id,
            node_id=node_id,
            tail=LOGS_TAIL_LINES,
            errors="replace",
            timeout=30,
        ):
            tail = (tail + chunk)[-LOGS_TAIL_CHARS:]
    except Exception as exc:  # the answer stands without its logs
        return f"(logs unavailable: {type(exc).__name__})"
    return tail


async def deliver(
    services: Any, config: ConfigRef, order: WorkOrder, outcome: dict[str, JsonValue]
) -> bool:
    """The answer into the session's inbox (create-only, event id = the work's id), then
    an activation: the same path as a webhook's after its inbox write."""
    event = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=order.session_id,
        source=WORK_SOURCE,
        event_id=order.work_id,
        type=event_type(outcome),
        received_at=services.clock.now(),
        correlation_id=order.correlation_id,
        epoch=order.epoch,
        data=outcome,
        trace_id=order.trace_id,
    )
    # Made for this one delivery: no standby set of its own (it would start processes
    # nobody adopts; the replicas' and the reconciler's sets serve the sessions).
    activator = await RayActivator.made(services, config, standbys=False)
    try:
        return await SessionService(services, activator).deliver(event)
    finally:
        # What it started behind the request (a stalled pool channel's host check) ends
        # with it, not mid-way when the watcher exits.
        await activator.close()


# A delivery that met a passing fault (the index or the store not answering for a moment)
# is tried again for about half a minute: given up at once, the recorded outcome waited
# for the reconciler's poll, at twice the work's expected duration (hours for a job).
DELIVER_ATTEMPTS = 6
DELIVER_BACKOFF = Backoff(base_s=0.5, cap_s=10.0)


async def deliver_patiently(
    services: Any, config: ConfigRef, order: WorkOrder, outcome: dict[str, JsonValue]
) -> None:
    """``deliver``, again after a retryable failure; one that stored the event and failed
    at the activation is woken by the next attempt (the event is already in the inbox)."""
    for attempt in range(DELIVER_ATTEMPTS):
        try:
            if await deliver(services, config, order, outcome) or attempt == 0:
                return
            activator = await RayActivator.made(services, config, standbys=False)
            try:
                await SessionService(services, activator).activate_for_event(order.session_id)
            finally:
                await activator.close()
            return
        except Exception as exc:
            retryable = bool(getattr(exc, "retryable", False)) or transient(exc)
            if not retryable or attempt + 1 == DELIVER_ATTEMPTS:
                raise
            log.warning(
                "work %s: delivering its outcome failed (%s), trying again",
                order.work_id,
                type(exc).__name__,
            )
            await asyncio.sleep(DELIVER_BACKOFF.delay_s(attempt))


# --- the runner (used wherever the agent's tools are loaded) ----------------------------


class RayWorkRunner:
    """``torpor.work.WorkRunner`` on Ray: one watcher actor per work id."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self._settings: Settings | None = None
        self._records: WorkRecords | None = None

    def configure(self, settings: Settings) -> None:
        # A tool object may outlive one deployment's services in a process (tests, a
        # notebook that rebuilds its client): the records follow the latest settings.
        if settings is not self._settings:
            self._settings, self._records = settings, None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            raise RuntimeError("a work tool is used before it was configured")
        return self._settings

    @property
    def records(self) -> WorkRecords:
        if self._records is None:
            self._records = WorkRecords(open_object_store(self.settings))
        return self._records

    async def start(self, order: WorkOrder) -> None:
        await self.records.save_order(order)
        config = ConfigRef.of_loaded(self.settings)
        for attempt in range(MAX_ATTEMPTS):
            try:
                # Off the loop (a lookup, then the name's registration: GCS calls that
                # held every session of a pool host). Past its deadline the dispatch fails
                # with ``ClusterUnavailable``, retryable; a watcher the GCS makes after
                # that is found by its name when the dispatch is tried again.
                handle = await create_named(
                    WorkWatcher,
                    config,
                    dict(order.as_data()),
                    self.launch,
                    name=watcher_name(order.work_id),
                    namespace=self.settings.namespace,
                    get_if_exists=True,
                    lifetime="detached",
                )
                if await _start(handle, order) == ACCEPTED:
                    return
            except _GONE:
                pass  # a watcher that was just exiting: ask a fresh one
            await asyncio.sleep(min(0.5, 0.02 * 2**attempt))
        raise RuntimeError(f"no watcher for work {order.work_id} took the order")

    async def status(self, work: str) -> WorkStatus:
        records = self.records
        outcome = await records.outcome(work)
        runs = await records.runs(work)
        if outcome is not None:
            return WorkStatus(WorkState.DONE, runs=runs, outcome=outcome)
        if await records.stopped(work):
            return WorkStatus(WorkState.CANCELLED, runs=runs)
        if await self._alive(work):
            return WorkStatus(WorkState.RUNNING, runs=runs)
        # Looked again: its watcher may have recorded the outcome and exited since the
        # first look; taken for lost, the wait could be answered work_lost beside it.
        outcome = await records.outcome(work)
        if outcome is not None:
            return WorkStatus(WorkState.DONE, runs=runs, outcome=outcome)
        if await records.order(work) is None:
            return WorkStatus(WorkState.UNKNOWN, runs=runs)
        cause = await records.lost_cause(work, runs) if runs else None
        if self.launch.kind is Kind.ACTOR and runs and cause in (None, WATCHER_GONE, CALL_CUT_OFF):
            # Its watcher is gone, or the actor was unreachable when the call's answer was
            # due, and the call may go on without it (an actor's method is no child of
            # its caller, and a running one cannot be cancelled): a run again could do the
            # work twice, side by side.
            what = (
                "was cut off (the actor could not be reached)"
                if cause == CALL_CUT_OFF
                else "lost its watcher"
            )
            return WorkStatus(
                WorkState.LOST,
                runs=runs,
                cause=f"its call to actor {self.launch.actor!r} {what}; "
                "the call may still run there, so it is not started again",
                rerunnable=False,
            )
        return WorkStatus(
            WorkState.LOST,
            runs=runs,
            cause=cause or "no process runs it any more (its node or process died)",
        )

    async def stop(self, work: str, *, reason: str) -> None:
        await self.records.stop(work, reason)  # first: no later dispatch starts it again
        try:
            handle = await get_actor(watcher_name(work), self.settings.namespace)
            await asyncio.wait_for(handle.stop.remote(), timeout=STATE_TIMEOUT_S)
        except RayTaskError as exc:
            # The watcher's own stop failed (its job's): Ray's wrapper is no answer for a
            # caller, who retries a typed retryable error (a compensation does).
            cause = exc.cause if exc.cause is not None else exc
            raise WorkStopFailed(
                f"work {work}: its stop failed: {type(cause).__name__}: {cause}"[:1000]
            ) from exc
        except (ActorUnavailableError, TimeoutError) as exc:
            # Not known gone (as ``_alive`` reads it): the GCS did not answer the lookup
            # within its deadline (``ClusterUnavailable``, or Ray's own
            # ``GetTimeoutError``: both ``TimeoutError``s), or the watcher did not take
            # the stop. Read as "no watcher", the stop of a task or an actor call was
            # reported done while the work ran on. A job is stopped through its own API;
            # the others' stop is asked again.
            if self.launch.kind is not Kind.JOB:
                raise WorkStopFailed(
                    f"work {work}: its watcher could not be reached to stop it: "
                    f"{type(exc).__name__}: {exc}"[:1000]
                ) from exc
            await self._stop_jobs(work)
        except _GONE:
            # No watcher: a task died with it, but a job outlives it (``_running_job``).
            if self.launch.kind is Kind.JOB:
                await self._stop_jobs(work)

    async def _stop_jobs(self, work: str) -> None:
        client = _job_client(self.launch)
        for run in range(1, await self.records.runs(work) + 1):
            await _stop_job(client, f"{work}-{run}")

    async def order(self, work: str) -> WorkOrder | None:
        return await self.records.order(work)

    async def _alive(self, work: str) -> bool:
        """False only for a watcher known gone (no actor by its name, or a dead one). One
        unreachable for a moment (unavailable, or no answer in time) may still run the
        work: taken for lost, an actor call's wait (or a last run's) was answered
        ``work_lost`` while the work ran on, and its real answer came too late."""
        try:
            handle = await get_actor(watcher_name(work), self.settings.namespace)
            state: dict[str, Any] = await asyncio.wait_for(
                handle.state.remote(), timeout=STATE_TIMEOUT_S
            )
        except (ActorUnavailableError, TimeoutError):
            return True  # not known gone: the next poll asks again
        except _GONE:
            return False
        return bool(state.get("running"))


async def _start(watcher: Any, order: WorkOrder) -> Any:
    """The watcher's answer to the start of ``order``'s run, or ``WorkStartUnanswered``
    past ``WATCHER_START_TIMEOUT_S``; the call's own errors as they came.

    Silence is its process not started yet on a busy node, or its node gone and not yet
    declared dead. The order is saved first (``start``), so nothing is lost, and the
    watcher is not killed: the start may still land and the work run. Asked again (the
    dispatch's retry, the next poll), the runner finds the same watcher by its name, whose
    ``start`` starts nothing a second time, or a fresh one, which starts only a run it
    claims (create-only) and delivers an outcome already recorded. Retried in the
    runner's own loop, a silent watcher held the caller ``MAX_ATTEMPTS`` times over."""
    deadline = asyncio.timeout(WATCHER_START_TIMEOUT_S)
    try:
        async with deadline:
            return await watcher.start.remote(order.run)
    except TimeoutError:
        if not deadline.expired():
            raise  # the call's own (Ray's ``GetTimeoutError``): the runner reads it as before
        raise WorkStartUnanswered(
            f"work {order.work_id}: its watcher did not answer the start of run {order.run} "
            f"within {WATCHER_START_TIMEOUT_S:g} s",
            timeout_s=WATCHER_START_TIMEOUT_S,
        ) from None


# --- public factories -------------------------------------------------------------------


def _spec(name: str, description: str, parameters: dict[str, Any] | None) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=description,
        parameters=parameters or {"type": "object", "properties": {}},
    )


def ray_task_tool(
    name: str,
    *,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    resources: Resources | None = None,
    retry: RetryPolicy | None = None,
    sla_s: float = 24 * 3600,
    expected_duration_s: float = 600,
    version: str = "1",
) -> Callable[[Callable[..., Any]], WorkTool]:
    """Decorator: ``fn(args, ctx: WorkContext) -> JSON`` becomes a long-running tool whose
    work is a Ray task with ``resources``; the session sleeps while it runs."""

    def wrap(fn: Callable[..., Any]) -> WorkTool:
        launch = Launch(Kind.TASK, resources or Resources(), fn=fn)
        return WorkTool(
            _spec(name, description or (fn.__doc__ or "").strip(), parameters),
            RayWorkRunner(launch),
            retry=retry,
            sla_s=sla_s,
            expected_duration_s=expected_duration_s,
            version=version,
        )

    return wrap


def ray_actor_tool(
    name: str,
    *,
    actor: str,
    method: str,
    namespace: str | None = None,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    sla_s: float = 24 * 3600,
    expected_duration_s: float = 600,
    version: str = "1",
) -> WorkTool:
    """A long-running tool whose work is ``method(args, ctx)`` of a named actor (e.g. a model
    server holding a GPU); the actor's own resources apply."""
    launch = Launch(Kind.ACTOR, actor=actor, actor_namespace=namespace, method=method)
    return WorkTool(
        _spec(name, description, parameters),
        RayWorkRunner(launch),
        retry=retry,
        sla_s=sla_s,
        expected_duration_s=expected_duration_s,
        version=version,
    )


def ray_job_tool(
    name: str,
    *,
    entrypoint: Callable[[dict[str, Any]], str],
    resources: Resources | None = None,
    address: str | None = None,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    sla_s: float = 24 * 3600,
    expected_duration_s: float = 3600,
    version: str = "1",
) -> WorkTool:
    """A long-running tool whose work is a Ray Job (``JobSubmissionClient``), submitted with
    ``submission_id`` = the work id and the entrypoint's resources."""
    launch = Launch(Kind.JOB, resources or Resources(), entrypoint=entrypoint, job_address=address)
    return WorkTool(
        _spec(name, description, parameters),
        RayWorkRunner(launch),
        retry=retry,
        sla_s=sla_s,
        expected_duration_s=expected_duration_s,
        version=version,
    )


# --- decoupled sync tools ---------------------------------------------------------------


def _call_tool(fn: Callable[..., Any], args: dict[str, Any], ctx: ToolContext) -> Any:
    out = fn(args, ctx)
    if asyncio.iscoroutine(out):
        return asyncio.run(out)
    return out


class RayTaskExecutor:
    """``torpor.work.TaskExecutor`` on Ray: each call is a task named by its call key."""

    def __init__(self) -> None:
        self._inflight: dict[str, Any] = {}

    async def run(
        self, fn: Any, args: dict[str, Any], ctx: ToolContext, *, execution: TaskExecution
    ) -> JsonValue:
        key = ctx.idempotency_key
        ref = self._inflight.get(key)
        if ref is None:  # joined while in flight: a retry in this process runs nothing twice
            options = {
                **execution.resources.ray_options(),
                "max_retries": execution.retries,
                "name": f"tool:{key}",
            }
            ref = ray.remote(_call_tool).options(**options).remote(fn, args, ctx)
            self._inflight[key] = ref
        started = time.monotonic()
        try:
            out: JsonValue = await ref
        except asyncio.CancelledError:
            # The loop's deadline passed: stop the task, its outcome is unknown.
            ray.cancel(ref, force=True)
            raise
        except RayTaskError as exc:
            raise exc.as_instanceof_cause() from None  # type: ignore[no-untyped-call]
        finally:
            # However it ended (a Ray failure too: a crashed worker, a memory kill), the
            # call is over: a ref kept would be joined by the same call again, dead.
            if self._inflight.get(key) is ref:
                del self._inflight[key]
        log.debug("task tool call %s took %.3f s", key, time.monotonic() - started)
        return out


def task_tool(
    name: str,
    *,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    execution: TaskExecution | None = None,
    version: str = "1",
) -> Callable[[Callable[..., Any]], ExecutedTool]:
    """Decorator: a sync tool ``fn(args, ctx)`` whose calls run as Ray tasks
    (``execution="task"``) with the given resources, timeout and retries."""

    def wrap(fn: Callable[..., Any]) -> ExecutedTool:
        return ExecutedTool(
            fn,
            _spec(name, description or (fn.__doc__ or "").strip(), parameters),
            RayTaskExecutor(),
            execution or TaskExecution(execution="task"),
            version,
        )

    return wrap
