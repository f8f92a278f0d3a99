"""Compute work as a tool: a Ray task, a Ray actor method or a Ray Job the session sleeps on.

A :class:`WorkTool` is a long-running tool whose far side is the cluster itself. ``begin``
plans the wait (answered by torpor's own events only); the outbox dispatch starts the work
under the business idempotency key ``tenant:action_key:epoch`` through a
:class:`WorkRunner`, which names the work by that key and looks it up first, so a
re-dispatch after a crash never starts it twice. The session actor then exits; the work
runs on its own and, when it ends, writes its result (or error) straight into the
session's inbox (create-only, event id = the work's id) and asks for an activation.

The reconciler's ``poll`` is the safety net for a lost runner: it asks the runner for the
work's state and the tool's :class:`RetryPolicy` decides between running it again under
the same key and failing the wait with the cause. Cancel and compensation stop the work.

Only declarations and pure decisions live here: the domain never imports Ray. The Ray
runner is ``actors.ray_work``; :class:`TaskExecution` is the same idea for a sync tool
whose call runs as a Ray task instead of inline (``execution = "task"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from torpor.deadlines import call_out
from torpor.ids import digest
from torpor.models import Wait
from torpor.settings import Settings
from torpor.tools import (
    DispatchRequest,
    LongRunningTool,
    PollOutcome,
    Tool,
    ToolContext,
    ToolSpec,
    WaitPlan,
)

WORK_SOURCE = "torpor"  # a reserved source name: no webhook can pose as the work
FINISHED = "torpor.work.finished"
FAILED = "torpor.work.failed"
# A result larger than this goes to object storage; the session gets a reference.
INLINE_RESULT_BYTES = 64 * 1024


class Resources(BaseModel):
    """What one run of the work needs from the cluster (Ray's own resource names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None  # bytes
    resources: dict[str, float] = Field(default_factory=dict)  # custom, e.g. {"fake_gpu": 1}
    runtime_env: dict[str, JsonValue] | None = None

    def ray_options(self) -> dict[str, Any]:
        """As keyword arguments of ``.options(...)`` for a task, an actor or a job."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.runtime_env is not None:
            options["runtime_env"] = dict(self.runtime_env)
        return options


class OnLost(StrEnum):
    RERUN = "rerun"  # run it again under the same key
    FAIL = "fail"  # answer the wait with the cause


class RetryPolicy(BaseModel):
    """What happens when the work is lost (its node died, its process was killed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    on_lost: OnLost = OnLost.RERUN
    max_runs: int = Field(default=2, ge=1)  # runs in all, the first one included


class WorkState(StrEnum):
    UNKNOWN = "unknown"  # never started under this key (or its record is gone)
    RUNNING = "running"
    DONE = "done"  # an outcome is recorded (its delivery may still be owed)
    LOST = "lost"  # started, no outcome, and nothing runs it any more
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class WorkStatus:
    state: WorkState
    runs: int = 0  # runs started so far under this key
    cause: str | None = None
    outcome: dict[str, JsonValue] | None = None  # the recorded answer, once DONE
    # LOST: whether a run again cannot overlap the lost one (False for a call that may
    # still run where nothing can stop it: the policy then answers with the cause).
    rerunnable: bool = True


@dataclass(frozen=True)
class WorkOrder:
    """Everything a runner needs to start the work and to answer its wait by itself."""

    work_id: str
    idempotency_key: str
    tool_name: str
    session_id: str
    tenant: str
    correlation_id: str
    epoch: int
    request: dict[str, JsonValue]
    deadline: datetime
    trace_id: str
    run: int = 1  # which run of the key this is (a re-run after a loss counts up)

    def as_data(self) -> dict[str, JsonValue]:
        return {
            "work_id": self.work_id,
            "idempotency_key": self.idempotency_key,
            "tool_name": self.tool_name,
            "session_id": self.session_id,
            "tenant": self.tenant,
            "correlation_id": self.correlation_id,
            "epoch": self.epoch,
            "request": self.request,
            "deadline": self.deadline.isoformat(),
            "trace_id": self.trace_id,
            "run": self.run,
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> WorkOrder:
        return cls(**{**data, "deadline": datetime.fromisoformat(str(data["deadline"]))})


def work_id(idempotency_key: str) -> str:
    """The work's name on the cluster and its answer's event id: one per business key."""
    return "w" + digest(idempotency_key, length=32)


def epoch_of(idempotency_key: str) -> int:
    return int(idempotency_key.rsplit(":", 1)[1])


class WorkRunner(Protocol):
    """Starts, inspects and stops the work of one tool on a cluster."""

    def configure(self, settings: Settings) -> None:
        """Given the deployment's settings once, before the first call (storage, namespace)."""

    async def start(self, order: WorkOrder) -> None:
        """Idempotent per ``order.work_id``: a running or finished work is not started
        again (a recorded but undelivered outcome is delivered instead)."""

    async def status(self, work: str) -> WorkStatus: ...

    async def stop(self, work: str, *, reason: str) -> None:
        """Stop the work and make sure no later dispatch starts it again."""

    async def order(self, work: str) -> WorkOrder | None:
        """The order recorded when the work was first started."""


# --- pure decisions -------------------------------------------------------------------


@dataclass(frozen=True)
class Rerun:
    run: int


@dataclass(frozen=True)
class Fail:
    cause: str


def after_loss(policy: RetryPolicy, status: WorkStatus) -> Rerun | Fail:
    """The retry policy's answer to a lost run."""
    cause = status.cause or "the work was lost"
    if policy.on_lost is OnLost.RERUN and status.rerunnable and status.runs < policy.max_runs:
        return Rerun(run=status.runs + 1)
    return Fail(f"{cause} (after {status.runs} run(s))")


def outcome_data(*, ok: bool, value: JsonValue) -> dict[str, JsonValue]:
    """How the work's end reads as the tool's answer."""
    if ok:
        return {"status": "ok", "result": value}
    return {"status": "error", "error": value}


def event_type(outcome: dict[str, JsonValue]) -> str:
    return FINISHED if outcome.get("status") == "ok" else FAILED


# --- the tool -------------------------------------------------------------------------


class WorkTool(LongRunningTool):
    """A long-running tool whose far side is compute on the cluster."""

    can_poll: ClassVar[bool] = True
    can_compensate: ClassVar[bool] = True

    def __init__(
        self,
        spec: ToolSpec,
        runner: WorkRunner,
        *,
        retry: RetryPolicy | None = None,
        sla_s: float = 24 * 3600,
        expected_duration_s: float = 600,
        version: str = "1",
    ) -> None:
        self.spec = spec
        self.runner = runner
        self.retry = retry or RetryPolicy()
        self.sla_s = sla_s
        self.expected_duration_s = expected_duration_s
        self.version = version

    def configure(self, settings: Settings) -> None:
        self.runner.configure(settings)

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        return WaitPlan(
            # One session's call: the session id keeps two sessions' calls apart.
            action_key=f"{self.spec.name}:{ctx.session_id}:{ctx.tool_call_id}",
            request=dict(args),
            sla_s=self.sla_s,
            expected_duration_s=self.expected_duration_s,
            expected_types=[FINISHED, FAILED],
            allowed_sources=[WORK_SOURCE],
        )

    async def dispatch(self, request: DispatchRequest) -> None:
        await self.runner.start(
            WorkOrder(
                work_id=work_id(request.idempotency_key),
                idempotency_key=request.idempotency_key,
                tool_name=self.spec.name,
                session_id=request.session_id,
                tenant=request.tenant,
                correlation_id=request.callback.correlation_id,
                epoch=epoch_of(request.idempotency_key),
                request=request.request,
                deadline=request.deadline,
                trace_id=request.trace_id,
            )
        )

    async def poll(self, wait: Wait, *, tenant: str) -> PollOutcome | None:
        """The safety net: an outcome whose delivery was lost, or a lost run."""
        work = work_id(wait.idempotency_key(tenant))
        status = await self.runner.status(work)
        if status.state is WorkState.DONE and status.outcome is not None:
            return PollOutcome(event_id=work, type=event_type(status.outcome), data=status.outcome)
        if status.state is not WorkState.LOST:
            return None
        decision = after_loss(self.retry, status)
        if isinstance(decision, Rerun):
            order = await self.runner.order(work)
            if order is not None:
                await self.runner.start(_rerun(order, decision.run))
                return None
            decision = Fail("the work's order is gone")
        return PollOutcome(
            event_id=f"{work}:lost",
            type=FAILED,
            data=outcome_data(ok=False, value={"code": "work_lost", "message": decision.cause}),
        )

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        await self.runner.stop(work_id(wait.idempotency_key(tenant)), reason=reason)


def _rerun(order: WorkOrder, run: int) -> WorkOrder:
    return WorkOrder(**{**order.__dict__, "run": run})


# --- decoupled sync tools (execution = "task") ----------------------------------------


class TaskExecution(BaseModel):
    """Where a sync tool's call runs: inline in the session's process, or as a task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    execution: Literal["inline", "task"] = "inline"
    resources: Resources = Field(default_factory=Resources)
    timeout_s: float | None = None  # None: the deployment's tool timeout
    retries: int = Field(default=0, ge=0)  # re-runs after the task's process is lost


class TaskExecutor(Protocol):
    async def run(
        self, fn: Any, args: dict[str, Any], ctx: ToolContext, *, execution: TaskExecution
    ) -> JsonValue:
        """Run ``fn(args, ctx)`` elsewhere, once per ``ctx.idempotency_key`` in flight."""


class ExecutedTool(Tool):
    """A sync tool whose calls run through a :class:`TaskExecutor` (e.g. as Ray tasks).

    The reasoning loop only awaits the result; the call is logged under the same
    ``H(session:step:call)`` key as an inline call, and that key names the task. The
    loop's deadline is the execution's ``timeout_s``."""

    def __init__(
        self,
        fn: Any,
        spec: ToolSpec,
        executor: TaskExecutor,
        execution: TaskExecution | None = None,
        version: str = "1",
    ) -> None:
        self.fn = fn
        self.spec = spec
        self.executor = executor
        self.execution = execution or TaskExecution(execution="task")
        self.timeout_s = self.execution.timeout_s
        self.version = version

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        if self.execution.execution == "inline":
            out: JsonValue = await call_out(
                self.fn, args, ctx, timeout_s=None, what=self.spec.name, key=ctx.idempotency_key
            )
            return out
        return await self.executor.run(self.fn, args, ctx, execution=self.execution)


# --- progress -------------------------------------------------------------------------


class Progress(BaseModel):
    """The last progress one work reported: kept beside the session, never in its snapshot,
    so reporting it wakes nothing."""

    model_config = ConfigDict(extra="forbid")

    work_id: str
    tool_name: str
    fraction: float = Field(ge=0.0, le=1.0)
    message: str = Field(default="", max_length=500)
    at: datetime


class ProgressRepository(Protocol):
    async def report(self, session_id: str, progress: Progress) -> None: ...

    async def of(self, session_id: str) -> list[Progress]:
        """Every work's last report, oldest work first."""
        ...

    async def clear(self, session_id: str, work: str) -> None: ...
