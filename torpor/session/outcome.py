"""How an activation ended, as the runtime reports it: the outcome and what it did."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from torpor.lifecycle import SessionState
from torpor.session.activation import Activation


class ActivationOutcome(StrEnum):
    """How one activation attempt ended, as the runtime reports it."""

    RAN = "ran"  # the activation ran and committed what it did
    BUSY = "busy"  # another activation holds the lease; it will see our events
    CONFLICT = "conflict"  # someone else committed first; nothing was written
    LEASE_LOST = "lease_lost"
    MISSING = "missing"  # no such session
    STOPPED = "stopped"  # ended early after a checkpoint (a retry is scheduled)
    QUARANTINED = "quarantined"  # set aside for an operator (unreadable, or retries spent)


@dataclass(frozen=True)
class ActivationResult:
    """The outcome of ``SessionRuntime.activate`` and what the activation did."""

    session_id: str
    outcome: ActivationOutcome
    state: SessionState | None = None
    generation: int | None = None
    applied: int = 0
    observed: int = 0
    agent_steps: int = 0
    drifts: int = 0
    # Seconds from the request (caller's wall clock) to the first agent step, if any.
    resume_latency_s: float | None = None


def result_of(
    act: Activation, outcome: ActivationOutcome, requested_at: float | None
) -> ActivationResult:
    """What ``act`` did, reported with ``outcome``; the resume latency from
    ``requested_at`` (the caller's wall clock) if it took an agent step."""
    latency = None
    first = act.stats.first_step_at
    if requested_at is not None and first is not None:
        latency = max(0.0, first.timestamp() - requested_at)
    return ActivationResult(
        session_id=act.snap.session_id,
        outcome=outcome,
        state=act.snap.state,
        generation=act.snap.generation,
        applied=act.stats.applied,
        observed=act.stats.observed,
        agent_steps=act.stats.agent_steps,
        drifts=act.stats.drifts,
        resume_latency_s=latency,
    )
