"""The session lifecycle state machine.

PENDING → RUNNING → SUSPENDED → RESUMING → RUNNING … → COMPLETED | FAILED | CANCELLED |
TIMED_OUT, and QUARANTINED aside: a session whose snapshot cannot be read or whose retries
are exhausted waits there for an operator, who retries (→ RUNNING) or cancels it.
``transition`` is the only way a snapshot's state changes: it refuses illegal
moves with a typed error, treats terminal states as immutable, and bumps the epoch when a
wait opens (RUNNING → SUSPENDED) or closes (leaving SUSPENDED/RESUMING for RUNNING or a
terminal state). The epoch is what the stale-callback gate compares: a callback stamped
with an older epoch belongs to a wait that is already closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from torpor.errors import IllegalTransition, TerminalStateImmutable

MAX_HISTORY = 256


class SessionState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"
    RESUMING = "RESUMING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"
    QUARANTINED = "QUARANTINED"  # set aside until an operator retries or cancels

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


S = SessionState
TERMINAL_STATES: frozenset[SessionState] = frozenset(
    {S.COMPLETED, S.FAILED, S.CANCELLED, S.TIMED_OUT}
)
WAITING_STATES: frozenset[SessionState] = frozenset({S.SUSPENDED, S.RESUMING})

ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    S.PENDING: frozenset({S.RUNNING, S.CANCELLED, S.FAILED, S.QUARANTINED}),
    S.RUNNING: frozenset({S.SUSPENDED, S.COMPLETED, S.FAILED, S.CANCELLED, S.QUARANTINED}),
    S.SUSPENDED: frozenset({S.RESUMING, S.CANCELLED, S.TIMED_OUT, S.FAILED, S.QUARANTINED}),
    # RESUMING → SUSPENDED: the activation found nothing applicable (only stale events, or
    # one of several parallel waits answered) and the session goes back to sleep.
    S.RESUMING: frozenset(
        {S.RUNNING, S.SUSPENDED, S.CANCELLED, S.TIMED_OUT, S.FAILED, S.QUARANTINED}
    ),
    # Only an operator moves a session out of quarantine: retry (RUNNING) or cancel.
    # SUSPENDED too: a session set aside while waiting goes back to its open waits; and
    # PENDING: one set aside before its first step starts it afresh (its messages).
    S.QUARANTINED: frozenset({S.PENDING, S.RUNNING, S.SUSPENDED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
    S.TIMED_OUT: frozenset(),
}


class HistoryEntry(BaseModel):
    """One transition, as the session's history and its event stream show it."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    seq: int
    at: datetime
    state: SessionState
    epoch: int
    reason: str = ""


class Stateful(Protocol):
    """What the state machine reads and copies: the session snapshot, seen from here
    without importing the models (which import this module)."""

    session_id: str
    state: SessionState
    epoch: int
    history: list[HistoryEntry]

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Self: ...


SnapshotT = TypeVar("SnapshotT", bound=Stateful)


def can_transition(source: SessionState, target: SessionState) -> bool:
    return target in ALLOWED[source]


def bumps_epoch(source: SessionState, target: SessionState) -> bool:
    opens_wait = source is S.RUNNING and target is S.SUSPENDED
    # Quarantine only sets a session aside: its waits stay open, and so does their epoch.
    closes_wait = (
        source in WAITING_STATES and target not in WAITING_STATES and target is not S.QUARANTINED
    )
    return opens_wait or closes_wait


def transition(
    snapshot: SnapshotT, target: SessionState, *, now: datetime, reason: str = ""
) -> SnapshotT:
    """Return a copy of ``snapshot`` in state ``target``; raise if the move is illegal."""
    source = snapshot.state
    if source.terminal:
        raise TerminalStateImmutable(
            f"session {snapshot.session_id} is {source} and can no longer change state",
            session_id=snapshot.session_id,
            state=source,
        )
    if not can_transition(source, target):
        raise IllegalTransition(
            f"session {snapshot.session_id} cannot go from {source} to {target}",
            session_id=snapshot.session_id,
            source=source,
            target=target,
        )
    epoch = snapshot.epoch + 1 if bumps_epoch(source, target) else snapshot.epoch
    seq = snapshot.history[-1].seq + 1 if snapshot.history else 1
    entry = HistoryEntry(seq=seq, at=now, state=target, epoch=epoch, reason=reason)
    return snapshot.model_copy(
        update={
            "state": target,
            "epoch": epoch,
            "updated_at": now,
            "history": [*snapshot.history, entry][-MAX_HISTORY:],
        }
    )
