"""The watcher of one work: a detached named actor, ``work:{work id}``, that starts the
work's run, awaits it, records the outcome and delivers it (``actors.work_delivery``).

It costs no CPU (``num_cpus=0``): it starts the work with the declared resources (a
task with ``resources={"gpu_node": 1}`` lands on such a node), awaits it, records the
outcome, writes it into the session's inbox and asks for an activation: the same path
a webhook takes after its inbox write. Then it exits. A run whose process or node dies
is recorded as lost; the reconciler's ``poll`` finds it and the tool's retry policy
decides. Nothing here polls in the normal case, but a Job's status (``actors.work_jobs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import ray
from pydantic import JsonValue
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    AsyncioActorExit,
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

from actors import exit_deadline
from actors.config_ref import ConfigRef
from actors.named import get_actor
from actors.wiring import open_services
from actors.work_delivery import deliver_patiently
from actors.work_jobs import _job_client, _logs_tail, _lost_to_ray, _no_such_job, _stop_job
from actors.work_launch import Kind, Launch, WorkContext
from storage.work import ObjectProgress, WorkRecords
from torpor.backoff import Backoff
from torpor.faults import crash_point
from torpor.ports import ObjectStore
from torpor.work import INLINE_RESULT_BYTES, Progress, WorkOrder, outcome_data

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

# How long a watcher waits between its looks at its own job (no reconciler): 0.5 s at
# first, so a quick job is seen quickly, then longer, to 15 s (±10%). A fixed 0.5 s for each
# job's whole life was 200 requests a second to one dashboard for 100 long jobs. The
# jitter keeps the watchers of jobs submitted together from asking in step.
JOB_STATUS_BACKOFF = Backoff(base_s=0.5, cap_s=15.0, factor=1.5, jitter=0.1)
SUBMIT_ATTEMPTS = 12  # about 45 s for a cluster's job agents to come up

# The lost cause a watcher records for a run claimed by a watcher that is gone: what that
# one started is not known to have ended (an actor's method may still run, ``status``).
WATCHER_GONE = "the process running it is gone"
# The lost cause of an actor call cut off by an actor that could not be reached, and was
# still there after: the call's answer is lost, but the call may still run in it.
CALL_CUT_OFF = "its actor could not be reached"


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
            # Its name must come free for the work's next run, whatever holds it: a call
            # still running, or the close below (it has no deadline of its own).
            exit_deadline.end_by(self._settings.runtime.actor_exit_grace_s, "work watcher")
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
