"""Tool protocols: sync tools run inline, long-running tools make the session sleep.

A *sync* tool runs during the activation; its result is logged under
``H(session_id:step:tool_call_id)`` and it receives that key so the external side can
dedupe a call that happened just before a crash.

A *long-running* tool never does its external work inline. ``begin`` only plans the wait
(what to ask for, the business key, the SLA, the guard baseline); the runtime records the
request in the outbox in the same commit that suspends the session, binds the callback
route, and only then calls ``dispatch`` with the business idempotency key
``tenant:action_key:epoch``. Optional hooks: ``poll`` (ask the external system when a
callback is overdue), ``current_state`` (for the State Invalidation Guard) and
``compensate`` (undo on timeout, cancel or drift).

Every call into a tool has a deadline: the tool's ``timeout_s``, or the deployment's
default when it is None. A plain ``def`` (a ``@sync_tool`` function, or a hook written
without ``async``) runs in a worker thread so it never stops the lease heartbeat.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from torpor.deadlines import call_out
from torpor.errors import ActionKeyIncomplete
from torpor.models import (
    DriftPolicy,
    FanInCondition,
    FanInSpec,
    GuardBaseline,
    ObservationReason,
    Wait,
)

if TYPE_CHECKING:
    from torpor.events import InboxEvent


class ToolSpec(BaseModel):
    """How the tool is described to a model (OpenAI function-calling schema)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class ToolContext:
    session_id: str
    tenant: str
    step: int
    tool_call_id: str
    idempotency_key: str  # H(session_id:step:tool_call_id) for sync tools
    trace_id: str
    now: datetime
    fence: int  # the session lease's fencing token: pass it on if the far side checks it
    variables: dict[str, JsonValue]


# What a segment of an action key reads like when the value behind it was missing.
MISSING_MARKERS = frozenset({"", "none", "null", "undefined", "nan"})


def _complete_action_key(value: str) -> str:
    # The action key becomes the far side's idempotency key: one built from a missing
    # value (``approve:None``) would make unrelated sessions collide on one action.
    # A typed error, not a ValueError: it fails the tool call with its own code.
    if any(part.strip().lower() in MISSING_MARKERS for part in value.split(":")):
        raise ActionKeyIncomplete(
            f"action key {value[:200]!r} has a missing segment", action_key=value[:200]
        )
    return value


# The longest SLA a wait may ask for: a century. A deadline must stay a time every
# index can store, with the binding grace added (``now + sla_s`` past year 9999
# overflowed in the activation, and one within the grace of it overflowed at the bind,
# after the commit that opened the wait); a negative one is no SLA either.
MAX_SLA_S = 100 * 365.25 * 24 * 3600


class MemberPlan(BaseModel):
    """One member of a fan-in wait: its own request, action key and route; what it leaves
    unset (sources, SLA, guard) it takes from the ``WaitPlan`` it belongs to."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(min_length=1, max_length=200)  # names the member in the result
    action_key: str
    request: dict[str, JsonValue] = Field(default_factory=dict)
    business_key: str | None = None
    allowed_sources: list[str] = Field(default_factory=list)
    sla_s: float | None = Field(None, ge=0, le=MAX_SLA_S, allow_inf_nan=False)
    guard: GuardBaseline | None = None

    @field_validator("action_key")
    @classmethod
    def _complete(cls, value: str) -> str:
        return _complete_action_key(value)


class WaitPlan(BaseModel):
    """What a long-running tool wants to wait for; the runtime turns it into a Wait.

    With ``members``, one wait per member (a fan-in group): the session wakes when
    ``fan_in``'s condition is met, and the tool call gets one aggregated result."""

    model_config = ConfigDict(extra="forbid")

    action_key: str
    request: dict[str, JsonValue] = Field(default_factory=dict)
    business_key: str | None = None
    sla_s: float = Field(24 * 3600, ge=0, le=MAX_SLA_S, allow_inf_nan=False)
    expected_duration_s: float = 3600
    expected_types: list[str] = Field(default_factory=list)
    allowed_sources: list[str] = Field(default_factory=list)
    guard: GuardBaseline | None = None
    on_drift: DriftPolicy = DriftPolicy.REPLAN
    members: list[MemberPlan] = Field(default_factory=list)
    fan_in: FanInSpec | None = None  # with members; None: all of them, fail_all
    progress: dict[str, JsonValue] = Field(default_factory=dict)  # the wait's tool state

    @field_validator("action_key")
    @classmethod
    def _complete(cls, value: str) -> str:
        return _complete_action_key(value)

    @model_validator(mode="after")
    def _members_fit(self) -> WaitPlan:
        if self.fan_in is not None and not self.members:
            raise ValueError("fan_in needs members")
        labels = [m.label for m in self.members]
        keys = [m.action_key for m in self.members]
        # Each member's request goes out under its own key tenant:action_key:epoch: two
        # members with one key would be deduplicated into one request by the far side.
        if len(set(labels)) != len(labels) or len(set(keys)) != len(keys):
            raise ValueError("fan-in members need distinct labels and distinct action keys")
        spec = self.fan_in
        quorum = spec.n if spec is not None and spec.condition is FanInCondition.N_OF_M else 0
        if (quorum or 0) > len(self.members):
            raise ValueError(f"a quorum of {quorum} needs at least {quorum} members")
        # A baseline stamped without a time zone (``datetime.now()``) cannot be compared
        # with the clock: the guard raised TypeError at every wake, and the session retried
        # its way to quarantine. Refused here, the tool's call fails at once, and says why.
        for baseline in (self.guard, *(m.guard for m in self.members)):
            if baseline is not None and baseline.captured_at.utcoffset() is None:
                raise ValueError("a guard baseline's captured_at needs a time zone (use ctx.now)")
        return self


@dataclass(frozen=True)
class CallbackRoute:
    """Where and how the external system should answer."""

    correlation_id: str
    capability_token: str | None  # for senders that cannot hold a shared secret
    callback_url: str | None


@dataclass(frozen=True)
class DispatchRequest:
    session_id: str
    tenant: str
    tool_call_id: str
    action_key: str
    idempotency_key: str  # tenant:action_key:epoch
    business_key: str | None
    request: dict[str, JsonValue]
    callback: CallbackRoute
    deadline: datetime
    trace_id: str


class ExternalState(BaseModel):
    """The external world as the guard sees it on wake."""

    model_config = ConfigDict(extra="forbid")

    version_tag: str | None = None
    fingerprint: str | None = None
    invalid_entities: dict[str, str] = Field(default_factory=dict)  # entity → why invalid


class PollOutcome(BaseModel):
    """A finished external action found by polling; delivered like a callback."""

    model_config = ConfigDict(extra="forbid")

    event_id: str
    type: str
    data: JsonValue = None


class ReviewAction(StrEnum):
    APPLY = "apply"  # the event answers the wait (with ``Review.answer``)
    OBSERVE = "observe"  # recorded with ``Review.reason``, never applied; the wait stays open
    REISSUE = "reissue"  # withdraw the request and send ``Review.request`` in a new epoch


@dataclass(frozen=True)
class ToolNotice:
    """A signed outbound notification the tool wants sent (through the deliveries)."""

    key: str  # unique per notice: a replay sends it once
    url: str
    event: str
    data: dict[str, JsonValue]


@dataclass(frozen=True)
class Review:
    """What a tool makes of an event that passed the gates (``LongRunningTool.review``)."""

    action: ReviewAction
    answer: JsonValue = None
    reason: ObservationReason | None = None
    progress: dict[str, JsonValue] | None = None  # the wait's new tool state, if it changed
    alert: list[str] = field(default_factory=list)  # security alert reasons
    notices: list[ToolNotice] = field(default_factory=list)
    request: dict[str, JsonValue] | None = None  # REISSUE: the new request
    # REISSUE: withdraw the old request (``compensate``): yes when it goes to someone else,
    # no when it was decided and the next stage follows.
    withdraw: bool = True


@dataclass(frozen=True)
class ToolTimer:
    """A point in time at which the tool wants to review its open wait again."""

    name: str
    at: datetime


class Tool:
    """Base for sync tools. Subclass and implement ``run``, or use ``@sync_tool``."""

    long_running: ClassVar[bool] = False
    spec: ToolSpec
    version: str = "1"
    timeout_s: float | None = None  # per call; None: the deployment's tool_timeout_s

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        raise NotImplementedError

    async def close(self) -> None:
        """Release connections the tool holds (called when its process shuts down)."""
        return


class LongRunningTool:
    """Base for long-running tools. ``begin`` and ``dispatch`` are required."""

    long_running: ClassVar[bool] = True
    spec: ToolSpec
    version: str = "1"
    timeout_s: float | None = None  # per hook call; None: the deployment's tool_timeout_s
    # The webhook sources that may answer this tool's waits (``WaitPlan.allowed_sources``
    # and the agent's ``answer_sources`` take precedence). None declared anywhere: only
    # torpor's own events and the wait's capability link answer it.
    answered_by: tuple[str, ...] = ()
    can_poll: ClassVar[bool] = False
    can_compensate: ClassVar[bool] = False
    checks_state: ClassVar[bool] = False

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        raise NotImplementedError

    async def dispatch(self, request: DispatchRequest) -> None:
        raise NotImplementedError

    async def poll(self, wait: Wait, *, tenant: str) -> PollOutcome | None:
        return None

    async def current_state(self, wait: Wait, *, tenant: str) -> ExternalState | None:
        return None

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        return None

    def review(self, wait: Wait, event: InboxEvent, *, now: datetime) -> Review | None:
        """Decide what an event that passed the gates does to ``wait`` (pure: no I/O).
        None: it answers the wait as it is (every tool but a reviewing one)."""
        return None

    def timers(self, wait: Wait) -> list[ToolTimer]:
        """Timers to set when ``wait`` is bound; each comes back to ``review`` as a
        ``tool_timer`` event named after it, if the wait is still open then."""
        return []

    def reassignment_refused(self, wait: Wait, approvers: list[str]) -> str | None:
        """Why an operator may not give ``wait`` to ``approvers`` (pure: no I/O), or None.
        Asked where the operator asks, so a refusal is their answer and not only an alert
        later; the tool's ``review`` decides again in the session, under its lease. A
        tool that reviews no event takes no reassignment and refuses it; one whose own
        ``review`` reads operator events (a plugin's, written before this method) is left
        to decide there, as it did before the API asked."""
        if type(self).review is not LongRunningTool.review:
            return None
        return "this wait's tool takes no reassignment"

    async def close(self) -> None:
        return None


AnyTool = Tool | LongRunningTool
SyncFn = Callable[[dict[str, Any], ToolContext], "JsonValue | Awaitable[JsonValue]"]


class FunctionTool(Tool):
    def __init__(self, fn: SyncFn, spec: ToolSpec, version: str = "1") -> None:
        self._fn = fn
        self.spec = spec
        self.version = version

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        # A plain def may block (a socket, a file, a CPU-bound parse): ``call_out`` runs
        # it off the loop, so the heartbeat that keeps the session's lease keeps running,
        # and joins a call under the same key that an earlier deadline abandoned.
        out: Any = await call_out(
            self._fn, args, ctx, timeout_s=None, what=self.spec.name, key=ctx.idempotency_key
        )
        return out  # type: ignore[no-any-return]


def sync_tool(
    name: str,
    *,
    description: str = "",
    parameters: dict[str, Any] | None = None,
    version: str = "1",
) -> Callable[[SyncFn], FunctionTool]:
    """Decorator: turn ``fn(args, ctx)`` into a registered-ready sync tool."""

    def wrap(fn: SyncFn) -> FunctionTool:
        spec = ToolSpec(
            name=name,
            description=description or (fn.__doc__ or "").strip(),
            parameters=parameters or {"type": "object", "properties": {}},
        )
        return FunctionTool(fn, spec, version)

    return wrap


class ToolRegistry:
    """Tools by name, as one agent sees them."""

    def __init__(self, tools: list[AnyTool] | None = None) -> None:
        self._tools: dict[str, AnyTool] = {}
        for tool in tools or []:
            self.register(tool)

    def register(self, tool: AnyTool) -> None:
        name = tool.spec.name
        if name in self._tools:
            raise ValueError(f"tool {name!r} is registered twice")
        self._tools[name] = tool

    def get(self, name: str) -> AnyTool | None:
        return self._tools.get(name)

    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def all(self) -> list[AnyTool]:
        return list(self._tools.values())

    def versions(self) -> dict[str, str]:
        return {name: t.version for name, t in self._tools.items()}

    def __contains__(self, name: object) -> bool:
        return name in self._tools
