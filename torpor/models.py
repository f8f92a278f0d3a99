"""The session snapshot: everything a session is, so it can leave memory and come back.

A snapshot is plain data (pydantic v2). It holds the conversation in OpenAI chat format,
the agent's private variables, the log of completed sync tool calls, the waits the session
is in, the outbox of external requests, and the bookkeeping the gates need (epoch,
generation, processed deliveries). Nothing in here refers to a process or a connection.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from torpor.ids import MIN_CORRELATION_ID_BITS, business_idempotency_key, correlation_id_bits
from torpor.lifecycle import MAX_HISTORY, HistoryEntry, SessionState

# 2 (0.4): the header carries the session's trace id and its open waits' routes, which
# an earlier node's header model refuses. The version says so first: such a node leaves
# the snapshot to a newer one (``SnapshotSchemaTooNew``) instead of calling it corrupt
# and quarantining a healthy session in the middle of a rolling upgrade.
SCHEMA_VERSION = 2
MAX_OBSERVATIONS = 128
_new_instance = object.__new__
_set_slot = object.__setattr__  # past BaseModel.__setattr__, as pydantic's own copy does


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's copy, without its generic steps: a resume copies its snapshot some 16
        times (each move, update, commit and chunk seal), and pydantic's shallow copy runs
        ``__copy__`` and ``copy.copy`` three times, ~160 bytecodes, where this is ~25.

        The same result for these models: no extra fields (``extra="forbid"``) and no
        private attributes, so a shallow copy is the field values and the set of fields
        given, both updated from ``update`` without validation, as pydantic's own does.
        Anything else (a deep copy, a private value) goes to pydantic's."""
        if deep or self.__pydantic_extra__ is not None or self.__pydantic_private__ is not None:
            return super().model_copy(update=update, deep=deep)
        values = self.__dict__.copy()
        if update:
            values.update(update)
            given = self.__pydantic_fields_set__ | update.keys()
        else:
            given = set(self.__pydantic_fields_set__)
        copied = _new_instance(type(self))
        _set_slot(copied, "__dict__", values)
        _set_slot(copied, "__pydantic_extra__", None)
        _set_slot(copied, "__pydantic_fields_set__", given)
        _set_slot(copied, "__pydantic_private__", None)
        return copied


# --- conversation (OpenAI chat format) ---------------------------------------------


class ToolCallFunction(_Model):
    name: str
    arguments: str = "{}"  # a JSON document as a string, exactly as the OpenAI API sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _tool_message_names_its_call(self) -> Message:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message must carry the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def to_openai(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


# --- waits -------------------------------------------------------------------------


class DriftPolicy(StrEnum):
    """What the State Invalidation Guard does when the world changed during the wait."""

    REPLAN = "replan"  # the agent gets a drift notice as the tool result and re-plans
    COMPENSATE = "compensate"  # undo the external action and end the session
    BLOCK = "block"  # write nothing more, raise a security alert, end the session


class GuardBaseline(_Model):
    """What the session relied on when it went to sleep, to be re-checked on wake."""

    version_tag: str | None = None
    fingerprint: str | None = None
    captured_at: datetime
    # How long the baseline may be trusted at all; past it the wake counts as drift even if
    # the version tag matches (e.g. a quote valid for 24 h).
    ttl_s: float | None = None
    # Entities whose validity must still hold on wake (e.g. {"approver": "u-17"}).
    entities: dict[str, str] = Field(default_factory=dict)


class Wait(_Model):
    wait_id: str
    correlation_id: str
    business_key: str | None = None
    waiting_step_id: str
    epoch: int
    action_key: str
    tool_name: str
    tool_call_id: str
    expected_types: list[str] = Field(default_factory=list)
    allowed_sources: list[str] = Field(default_factory=list)
    # True for every wait opened since 0.2: ``allowed_sources`` is then the whole list of
    # who may answer (empty: torpor's own events and the capability link only). A wait
    # stored by 0.1 lacks the field and keeps 0.1's rule (empty: any source of the tenant),
    # so waits already open across the upgrade can still be answered.
    sources_declared: bool = False
    opened_at: datetime
    deadline: datetime
    expected_duration_s: float
    guard: GuardBaseline | None = None
    on_drift: DriftPolicy = DriftPolicy.REPLAN
    request: dict[str, JsonValue] = Field(default_factory=dict)
    polls: int = 0
    # An earlier wait of this session used the same business key (a re-plan): an answer
    # addressed by that key alone could be a late answer to the superseded request.
    replanned: bool = False
    # The fan-in group this wait is a member of (``SessionSnapshot.fan_ins``); None: a
    # single wait, answered and applied on its own as before fan-in existed.
    group_id: str | None = None
    # State the wait's tool keeps while the wait is open (an approval tool: the approvals
    # collected so far), committed with the snapshot like everything else.
    progress: dict[str, JsonValue] = Field(default_factory=dict)
    # How many requests this wait's tool call sent before this one in the same epoch: a
    # request reissued without moving the epoch (a fan-in member's next approval stage,
    # whose group's other members hang on the epoch) needs idempotency keys of its own.
    reissued: int = 0

    @model_serializer(mode="wrap")
    def _single_wait_as_before(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A wait outside any group is written byte for byte as before fan-in existed, so
        # a node still on the earlier version (extra="forbid") can read it mid-upgrade;
        # so is one never reissued in its epoch.
        data = handler(self)
        if self.group_id is None and isinstance(data, dict):
            data.pop("group_id", None)
        if not self.reissued and isinstance(data, dict):
            data.pop("reissued", None)
        return data

    def idempotency_key(self, tenant: str) -> str:
        """The key the far side dedupes this wait's request on (its undo adds a suffix)."""
        return business_idempotency_key(tenant, self.action_key, self.epoch, reissued=self.reissued)

    @field_validator("correlation_id")
    @classmethod
    def _unguessable(cls, value: str) -> str:
        if correlation_id_bits(value) < MIN_CORRELATION_ID_BITS:
            raise ValueError(f"correlation_id must carry at least {MIN_CORRELATION_ID_BITS} bits")
        return value

    @property
    def overdue_after(self) -> datetime:
        """When a missing callback becomes suspicious enough to poll (2× expected)."""
        return self.opened_at + timedelta(seconds=2 * self.expected_duration_s)


# --- fan-in groups ------------------------------------------------------------------


class FanInCondition(StrEnum):
    """How many members of a fan-in group must answer before the session wakes."""

    ALL = "all"
    ANY = "any"
    N_OF_M = "n_of_m"


class ExpiryPolicy(StrEnum):
    """What one member whose deadline passed does to its group."""

    FAIL_ALL = "fail_all"  # the whole wait times out (the session ends TIMED_OUT)
    PROCEED_WITH_ARRIVED = "proceed_with_arrived"  # the member counts as missing


class FanInSpec(_Model):
    """The condition of a fan-in group, as a tool or an agent's configuration asks for it."""

    condition: FanInCondition = FanInCondition.ALL
    n: int | None = Field(default=None, ge=1)  # only for ``n_of_m``
    on_expiry: ExpiryPolicy = ExpiryPolicy.FAIL_ALL

    @model_validator(mode="after")
    def _n_for_quorum(self) -> FanInSpec:
        if (self.condition is FanInCondition.N_OF_M) != (self.n is not None):
            raise ValueError("n is given exactly when the condition is n_of_m")
        return self


class MemberStatus(StrEnum):
    OPEN = "open"
    ANSWERED = "answered"
    FAILED = "failed"  # its request could not be sent: answered, but it does not count
    EXPIRED = "expired"
    CANCELLED = "cancelled"  # closed because the group resolved without it


class FanInMember(_Model):
    wait_id: str
    correlation_id: str
    tool_call_id: str
    label: str
    status: MemberStatus = MemberStatus.OPEN
    answer: JsonValue = None


class FanIn(_Model):
    """A set of member waits and the condition that wakes the session.

    ``aggregate_call_id`` set: one tool planned every member and gets one aggregated
    result for that call; None: each member is its own tool call (several long-running
    calls in one agent turn) and gets its own tool result."""

    group_id: str
    spec: FanInSpec = Field(default_factory=FanInSpec)
    aggregate_call_id: str | None = None
    members: list[FanInMember]


# --- outbox ------------------------------------------------------------------------


class OutboxKind(StrEnum):
    START = "start"  # start a long-running tool's external work
    COMPENSATE = "compensate"  # undo it (timeout, cancel, drift)
    NOTIFY = "notify"  # tell the submitter about a state change


class DispatchStatus(StrEnum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    FAILED = "failed"  # a start gave up (permanent error or attempts exhausted); its wait is told
    DEAD = "dead"  # any other entry gave up: a dead letter, kept until an operator resends it


class OutboxEntry(_Model):
    entry_id: str
    kind: OutboxKind
    tool_name: str | None = None
    tool_call_id: str | None = None
    correlation_id: str | None = None
    idempotency_key: str
    payload: dict[str, JsonValue] = Field(default_factory=dict)
    status: DispatchStatus = DispatchStatus.PENDING
    attempts: int = 0
    next_attempt_at: datetime | None = None
    last_error: str | None = None
    created_at: datetime
    dispatched_at: datetime | None = None


# --- the rest of the snapshot ------------------------------------------------------


class AgentRef(_Model):
    name: str
    version: str


class RetryQuota(_Model):
    """Retries of the session core (agent step, timed-out call, guard) before the session
    is QUARANTINED; a success starts the count afresh."""

    max_attempts: int = 3
    used: int = 0

    @property
    def exhausted(self) -> bool:
        return self.used >= self.max_attempts


class Quarantine(_Model):
    """Why a session was set aside, and where an operator's retry takes it back to."""

    reason: str
    code: str
    at: datetime
    attempts: int = 0  # retries spent before it was set aside
    resume_to: SessionState = SessionState.RUNNING


class ToolLogEntry(_Model):
    key: str
    tool_name: str
    tool_call_id: str
    step: int
    result: JsonValue
    completed_at: datetime


class ObservationReason(StrEnum):
    STALE = "stale"  # older epoch, another step, or a wait that already closed
    DUPLICATE = "duplicate"
    LATE = "late"  # arrived after the session ended
    UNEXPECTED = "unexpected"  # type or source the wait did not ask for
    CROSS_TENANT = "cross_tenant"
    UNKNOWN = "unknown_correlation"
    # Reviewed by the wait's tool (``LongRunningTool.review``), never applied as the answer:
    UNAUTHORIZED = "unauthorized"  # the answer's approver has no authority for the request
    COUNTED = "counted"  # an approval recorded towards a quorum; the wait stays open
    REMINDER = "reminder"  # a reminder was sent for the wait
    ESCALATED = "escalated"  # the request went to the next approver (a new epoch)
    REASSIGNED = "reassigned"  # an operator gave the request to other approvers


class Observation(_Model):
    """An event that was recorded but not applied (observe-only)."""

    event_key: str
    source: str
    type: str
    reason: ObservationReason
    at: datetime


class ErrorInfo(_Model):
    code: str
    message: str
    detail: dict[str, JsonValue] = Field(default_factory=dict)


class HistoryChunks(_Model):
    """Where the oldest part of a session's append-only lists lives once sealed.

    A long session's messages, tool log and processed event ids are sealed, ``size``
    items at a time, into immutable chunk objects beside the snapshot
    (``storage/chunks.py``); each list here names its chunks by content digest, oldest
    first. The snapshot in memory still holds every item: only what a commit writes is
    bounded. A snapshot stored before chunks existed has none, which is this default.
    """

    # Positive: ``seal`` steps through each list this many items at a time, and at 0 or
    # less it looped for ever (a damaged snapshot is refused on load instead).
    size: int = Field(64, ge=1)
    messages: list[str] = Field(default_factory=list)
    tool_log: list[str] = Field(default_factory=list)
    processed_events: list[str] = Field(default_factory=list)


class _OpenWork:
    """Reads of a session's open waits and outbox: the whole snapshot's and those of the
    part repair and the sweeps read (``WaitingSession``)."""

    if TYPE_CHECKING:
        state: SessionState
        waits: list[Wait]
        outbox: list[OutboxEntry]

    def wait_for(self, correlation_id: str) -> Wait | None:
        return next((w for w in self.waits if w.correlation_id == correlation_id), None)

    def pending_outbox(self) -> list[OutboxEntry]:
        return [e for e in self.outbox if e.status is DispatchStatus.PENDING]

    @property
    def terminal(self) -> bool:
        return self.state.terminal


class SessionSnapshot(_OpenWork, _Model):
    schema_version: int = SCHEMA_VERSION
    session_id: str
    tenant: str
    agent: AgentRef
    state: SessionState = SessionState.PENDING
    epoch: int = 0
    generation: int = 0
    trace_id: str
    step: int = 0
    input: JsonValue = None
    metadata: dict[str, str] = Field(default_factory=dict)
    callback_url: str | None = None
    batch_id: str | None = None
    messages: list[Message] = Field(default_factory=list)
    variables: dict[str, JsonValue] = Field(default_factory=dict)
    retry: RetryQuota = Field(default_factory=RetryQuota)
    tool_log: dict[str, ToolLogEntry] = Field(default_factory=dict)
    waits: list[Wait] = Field(default_factory=list)
    outbox: list[OutboxEntry] = Field(default_factory=list)
    processed_events: list[str] = Field(default_factory=list)
    observations: list[Observation] = Field(default_factory=list)
    history: list[HistoryEntry] = Field(default_factory=list)
    result: JsonValue = None
    error: ErrorInfo | None = None
    quarantine: Quarantine | None = None  # set while the state is QUARANTINED
    # business key → the last epoch whose wait used it (how a re-plan is recognised)
    business_keys: dict[str, int] = Field(default_factory=dict)
    lease_fence: int = 0
    fan_ins: list[FanIn] = Field(default_factory=list)  # open fan-in groups
    chunks: HistoryChunks = Field(default_factory=HistoryChunks)
    created_at: datetime
    updated_at: datetime

    @model_serializer(mode="wrap")
    def _without_groups_as_before(self, handler: SerializerFunctionWrapHandler) -> Any:
        # No fan-in group open: written as before fan-in existed (see ``Wait``).
        data = handler(self)
        if not self.fan_ins and isinstance(data, dict):
            data.pop("fan_ins", None)
        return data

    @field_validator("history")
    @classmethod
    def _bounded_history(cls, value: list[HistoryEntry]) -> list[HistoryEntry]:
        return value[-MAX_HISTORY:]

    @field_validator("observations")
    @classmethod
    def _bounded_observations(cls, value: list[Observation]) -> list[Observation]:
        return value[-MAX_OBSERVATIONS:]


class WaitingSession(_OpenWork, BaseModel):
    """What the index repair and the reconciler's sweeps (deadlines, polls, tool timers)
    read of a stored session: who it is, its open waits, its outbox and the processed
    event ids the snapshot holds (the unsealed tail; ``chunks`` names the rest), not its
    conversation, tool log or variables. Validating those was most of a repair's CPU: a
    12-message session's snapshot decoded whole takes 0.16 ms here (0.37 ms in the two
    steps every load took before), this part 0.08 ms (``bench/bench_storage.py``)."""

    model_config = ConfigDict(extra="ignore")  # the snapshot's other fields, skipped

    schema_version: int = SCHEMA_VERSION
    session_id: str
    tenant: str
    agent: AgentRef
    state: SessionState = SessionState.PENDING
    generation: int = 0
    waits: list[Wait] = Field(default_factory=list)
    outbox: list[OutboxEntry] = Field(default_factory=list)
    processed_events: list[str] = Field(default_factory=list)
    chunks: HistoryChunks = Field(default_factory=HistoryChunks)
    updated_at: datetime
    batch_id: str | None = None  # repair gives a batch's sessions their running caps back


# A session waiting on more waits than this has no wait routes in its header (the edge
# then reads the whole snapshot): the header stays small enough for one ranged read.
MAX_HEADER_WAITS = 16


class WaitRoute(_Model):
    """What the webhook edge needs of one open wait to judge an answer before storing it
    (``WebhookGateway``): who may answer it, and whether its business key was re-planned.
    The field names are ``Wait``'s, so the same gate rules read either."""

    correlation_id: str
    allowed_sources: list[str] = Field(default_factory=list)
    sources_declared: bool = False
    replanned: bool = False

    @classmethod
    def of(cls, wait: Wait) -> WaitRoute:
        return cls(
            correlation_id=wait.correlation_id,
            allowed_sources=wait.allowed_sources,
            sources_declared=wait.sources_declared,
            replanned=wait.replanned,
        )


class SessionHeader(_Model):
    """The few fields stored uncompressed in front of an encoded snapshot.

    Listing sessions by state for repair reads only this header (a ranged read), not the
    whole compressed body; so does the webhook edge, which needs only the open waits'
    routes and the session's trace id (decompressing and validating the whole snapshot
    was a third of a webhook's CPU).
    """

    session_id: str
    tenant: str
    agent: str  # lets an activator route the session without reading the whole snapshot
    state: SessionState
    generation: int
    epoch: int
    schema_version: int
    updated_at: datetime
    # Since 0.4; None in an older header (or past MAX_HEADER_WAITS): read the snapshot.
    trace_id: str | None = None
    waits: list[WaitRoute] | None = None

    def route_for(self, correlation_id: str) -> WaitRoute | None:
        assert self.waits is not None
        return next((w for w in self.waits if w.correlation_id == correlation_id), None)

    @classmethod
    def of(cls, snapshot: SessionSnapshot) -> SessionHeader:
        waits = snapshot.waits
        return cls(
            session_id=snapshot.session_id,
            tenant=snapshot.tenant,
            agent=snapshot.agent.name,
            state=snapshot.state,
            generation=snapshot.generation,
            epoch=snapshot.epoch,
            schema_version=snapshot.schema_version,
            updated_at=snapshot.updated_at,
            trace_id=snapshot.trace_id,
            waits=[WaitRoute.of(w) for w in waits] if len(waits) <= MAX_HEADER_WAITS else None,
        )
