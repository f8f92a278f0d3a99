"""The gates an inbox event passes before it may change a session, in order.

1. epoch/step gate — the event must name a wait the session is in *now*: same
   correlation id, same epoch, same waiting step. Anything else is stale: recorded as an
   observation, never applied. This is what stops a late step-2 callback from rewriting
   a session that has moved on to step 4.
2. delivery dedup — a (source, event id) already processed is dropped.
3. admission — the wait names the sources that may answer it (none: torpor's own
   events and its capability link only), and may restrict event types.
4. SLA deadline — an event received after the wait's deadline does not resume it; the
   session times out instead.

The State Invalidation Guard (``torpor.guard``) comes after these, because it needs I/O.
All of this is pure: the snapshot, the event and ``now`` in, a decision out.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from torpor.events import EventKind, InboxEvent
from torpor.models import (
    FanInMember,
    MemberStatus,
    ObservationReason,
    SessionSnapshot,
    Wait,
    WaitRoute,
)

# Events only torpor itself writes (never a webhook): no source or type filter applies.
TORPOR_KINDS = frozenset(
    {EventKind.POLL, EventKind.DISPATCH_FAILED, EventKind.TOOL_TIMER, EventKind.OPERATOR}
)


class Verdict(StrEnum):
    APPLY = "apply"
    OBSERVE = "observe"  # record, do not apply
    EXPIRED = "expired"  # the wait's deadline passed before the event arrived


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    wait: Wait | None = None
    reason: ObservationReason | None = None


def find_wait(snapshot: SessionSnapshot, event: InboxEvent) -> Wait | None:
    if event.correlation_id:
        return snapshot.wait_for(event.correlation_id)
    if event.business_key:
        return next((w for w in snapshot.waits if w.business_key == event.business_key), None)
    return None


def classify(
    snapshot: SessionSnapshot, event: InboxEvent, *, processed: Collection[str]
) -> Decision:
    """Decide what a callback-like event may do to ``snapshot``."""
    if snapshot.terminal:
        return Decision(Verdict.OBSERVE, reason=ObservationReason.LATE)
    wait = find_wait(snapshot, event)
    stale = (
        wait is None
        or (event.epoch is not None and event.epoch != wait.epoch)
        or (event.step_id is not None and event.step_id != wait.waiting_step_id)
        or wait.epoch != snapshot.epoch
    )
    member = closed_member(snapshot, event.correlation_id) if wait is None else None
    if member is not None:
        # A fan-in member whose wait closed while its group is still open. One that
        # expired was not answered: an answer now came after its deadline (late, as a
        # single wait's would be), and calling it a duplicate would claim one arrived.
        if member.status is MemberStatus.EXPIRED:
            return Decision(Verdict.OBSERVE, reason=ObservationReason.LATE)
        return Decision(Verdict.OBSERVE, reason=ObservationReason.DUPLICATE)
    if stale or wait is None:
        return Decision(Verdict.OBSERVE, reason=ObservationReason.STALE)
    if event.key in processed:
        return Decision(Verdict.OBSERVE, wait, ObservationReason.DUPLICATE)
    # Polls and dispatch failures are torpor's own, the driver's deliveries come through
    # the control plane (the client's, the operator console's), and a capability token
    # already names the one wait it may answer: type and source filters add nothing for
    # those. Every other event must come from a source the wait names; a wait that names
    # none is answered by those alone.
    internal = event.kind in TORPOR_KINDS or event.verified_by in (
        "capability",
        "client",
        "operator",  # an operator's takeover from the console (authenticated, audited)
    )
    if not internal and (
        (wait.expected_types and event.type not in wait.expected_types)
        or (may_restrict(wait) and event.source not in wait.allowed_sources)
    ):
        return Decision(Verdict.OBSERVE, wait, ObservationReason.UNEXPECTED)
    if event.received_at > wait.deadline:
        return Decision(Verdict.EXPIRED, wait)
    return Decision(Verdict.APPLY, wait)


def closed_member(snapshot: SessionSnapshot, correlation_id: str | None) -> FanInMember | None:
    """The member ``correlation_id`` names in an open fan-in group, if it is closed there
    (answered, failed or expired)."""
    if correlation_id is None:
        return None
    return next(
        (
            m
            for g in snapshot.fan_ins
            for m in g.members
            if m.correlation_id == correlation_id and m.status is not MemberStatus.OPEN
        ),
        None,
    )


def expired_waits(snapshot: SessionSnapshot, *, now: datetime) -> list[Wait]:
    return [w for w in snapshot.waits if w.deadline <= now]


def may_restrict(wait: Wait | WaitRoute) -> bool:
    """Whether the wait's source list is the whole answer to "who may answer": always for
    waits opened since 0.2; for a 0.1 wait only when it named sources."""
    return wait.sources_declared or bool(wait.allowed_sources)
