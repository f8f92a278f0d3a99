"""Compute work on Ray as a tool (``torpor.work``): a task, an actor method or a Job.

Each work is watched by one detached named actor, ``work:{work id}`` in the deployment's
namespace, where the work id is a digest of the business key ``tenant:action_key:epoch``.
The name is the lookup: a re-dispatch after a crash finds the watcher that is already
running and changes nothing. Past the name, the create-only records of
``storage.work`` decide: a run is started only by the process that claims its number, an
outcome once recorded is the answer for good, a stopped work is never started again.

Its parts, one concept each: ``actors.work_launch`` (what a work is: its kind, launch,
context and watcher's name), ``actors.work_watcher`` (the watcher actor),
``actors.work_jobs`` (a Job's run through the Jobs API), ``actors.work_delivery`` (an
outcome into its session), ``actors.task_tools`` (sync tools run as Ray tasks). This
module is the runner (``torpor.work.WorkRunner``) and the tool factories; it re-exports
the names tools and tests import from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)

from actors.config_ref import ConfigRef
from actors.named import create_named, get_actor
from actors.task_tools import RayTaskExecutor, task_tool
from actors.work_jobs import _job_client, _stop_job
from actors.work_launch import Kind, Launch, WorkContext, _spec, watcher_name
from actors.work_watcher import ACCEPTED, CALL_CUT_OFF, WATCHER_GONE, WorkWatcher
from storage.factory import open_object_store
from storage.work import WorkRecords
from torpor.errors import WorkStartFailed, WorkStartUnanswered, WorkStopFailed
from torpor.settings import Settings
from torpor.work import Resources, RetryPolicy, WorkOrder, WorkState, WorkStatus, WorkTool

__all__ = [
    "Kind",
    "Launch",
    "RayTaskExecutor",
    "RayWorkRunner",
    "WorkContext",
    "WorkWatcher",
    "ray_actor_tool",
    "ray_job_tool",
    "ray_task_tool",
    "task_tool",
    "watcher_name",
]

_GONE = (RayActorError, ActorDiedError, ActorUnavailableError, GetTimeoutError, ValueError)
MAX_ATTEMPTS = 40
STATE_TIMEOUT_S = 5.0
# A watcher's ``start`` answers at once once its process runs; the first call to a new
# one also waits for that process to start (seconds on a busy node, where Ray starts a
# few workers at a time). Shorter than a dispatch's own deadline (the tool's, else 60 s),
# so its caller sees why, typed and retryable (``WorkStartUnanswered``).
WATCHER_START_TIMEOUT_S = 30.0


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
        raise WorkStartFailed(f"no watcher for work {order.work_id} took the order")

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
