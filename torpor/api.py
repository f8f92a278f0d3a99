"""Request and response bodies of the HTTP API (they are also its OpenAPI schema)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictInt

from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SessionCreate(_Body):
    agent: str = Field(min_length=1, max_length=128)
    input: JsonValue = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    callback_url: str | None = Field(default=None, max_length=2048)


class BatchCreate(_Body):
    agent: str = Field(min_length=1, max_length=128)
    documents: list[JsonValue] = Field(min_length=1, max_length=10_000)
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    callback_url: str | None = Field(default=None, max_length=2048)
    # Lower than the configured cap only: configuration bounds every batch. Strict: true
    # was taken as 1 and "5" as 5, a cap the sender never wrote.
    max_running: StrictInt | None = Field(default=None, ge=1, le=100_000)


class Accepted(BaseModel):
    session_id: str
    state: SessionState
    created: bool
    links: dict[str, str]
    callback_secret: str | None = None  # verify our notifications to callback_url with it


class WaitOut(BaseModel):
    wait_id: str
    tool: str
    correlation_id: str
    business_key: str | None
    epoch: int
    opened_at: datetime
    deadline: datetime
    group_id: str | None = None  # the fan-in group the wait is a member of


class SessionOut(BaseModel):
    session_id: str
    tenant: str
    agent: str
    agent_version: str
    state: SessionState
    epoch: int
    generation: int
    waits: list[WaitOut]
    result: JsonValue = None
    error: dict[str, Any] | None = None
    batch_id: str | None = None
    created_at: datetime
    updated_at: datetime
    observations: int
    trace_id: str
    quarantine: dict[str, Any] | None = None  # why it is set aside, while QUARANTINED
    # What running compute work last reported (``torpor.work``): outside the snapshot.
    progress: list[dict[str, JsonValue]] = Field(default_factory=list)

    @classmethod
    def of(cls, s: SessionSnapshot) -> SessionOut:
        return cls(
            session_id=s.session_id,
            tenant=s.tenant,
            agent=s.agent.name,
            agent_version=s.agent.version,
            state=s.state,
            epoch=s.epoch,
            generation=s.generation,
            waits=[
                WaitOut(
                    wait_id=w.wait_id,
                    tool=w.tool_name,
                    correlation_id=w.correlation_id,
                    business_key=w.business_key,
                    epoch=w.epoch,
                    opened_at=w.opened_at,
                    deadline=w.deadline,
                    group_id=w.group_id,
                )
                for w in s.waits
            ],
            result=s.result,
            error=s.error.model_dump(mode="json") if s.error else None,
            batch_id=s.batch_id,
            created_at=s.created_at,
            updated_at=s.updated_at,
            observations=len(s.observations),
            trace_id=s.trace_id,
            quarantine=s.quarantine.model_dump(mode="json") if s.quarantine else None,
        )


class SessionItem(BaseModel):
    session_id: str
    state: SessionState | None


class SessionList(BaseModel):
    items: list[SessionItem]
    next_cursor: str | None


class BatchAdmission(BaseModel):
    """The caps on RUNNING sessions and their use now."""

    max_running: int  # this batch's cap
    max_running_per_tenant: int  # the cap on all of the tenant's batches together
    running: int
    waiting: int  # queued for a slot (PENDING, or woken but not yet admitted)
    tenant_running: int


class BatchOut(BaseModel):
    batch_id: str
    agent: str
    total: int
    done: int
    finished: bool
    by_state: dict[str, int]
    # The first documents' current sessions (their latest retry's), in order: a page of
    # ``GET /v1/batches/{id}/sessions``. ``next_cursor`` continues it there (None: all).
    session_ids: list[str]
    links: dict[str, str]
    next_cursor: str | None = None
    created: int = 0  # documents whose session exists (the fan-out runs behind the 202)
    cancelled: bool = False
    eta_s: float | None = None  # at the rate so far; None until a first document ended
    admission: BatchAdmission | None = None  # None where caps are off (embedded SQLite)
    purged: int = 0  # documents whose ended session retention deleted (done, not by_state)


class BatchSessionItem(BaseModel):
    index: int  # the document's place in the batch
    session_id: str  # its current session (its latest retry's)


class BatchSessionList(BaseModel):
    items: list[BatchSessionItem]
    next_cursor: str | None


class ApprovalReassign(_Body):
    """An operator's reassignment of an open approval."""

    approvers: list[str] = Field(min_length=1, max_length=32)
    reason: str = Field(default="", max_length=1000)
