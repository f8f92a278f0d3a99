"""Fan-in groups, the pure part: when a group's condition is met, and what it answers.

A group is a set of member waits (each with its own correlation id, epoch, deadline and
outbox entry, each answer gated on its own) and a condition: ``all``, ``any`` or ``n`` of
``m``. A member is OPEN until it is answered (ANSWERED), its request could not be sent
(FAILED: answered, but it does not count towards the condition), its deadline passed under
``proceed_with_arrived`` (EXPIRED), or the group resolved without it (CANCELLED).

The group resolves as soon as the outcome is decided: MET once enough members answered,
UNMEETABLE once too few are left open to ever meet it. Either way the session wakes with
what arrived; the members still open are closed (cancelled or compensated by the caller,
as are the expired ones).
Nothing here does I/O: the group in, a new group or a decision out.
"""

from __future__ import annotations

import secrets
from enum import StrEnum

from pydantic import JsonValue

from torpor.models import FanIn, FanInCondition, FanInMember, FanInSpec, MemberStatus, Wait


class Outcome(StrEnum):
    PENDING = "pending"  # not decided yet: keep sleeping
    MET = "met"
    UNMEETABLE = "unmeetable"  # too few members left open to meet the condition


def new_group_id() -> str:
    # Unique within its session is enough: a group is always looked up in its snapshot.
    return "g_" + secrets.token_hex(4)


def needed(spec: FanInSpec, members: int) -> int:
    """How many answered members meet ``spec`` among ``members`` (a quorum larger than
    the group, as an agent-wide ``n`` may be for a short turn, needs all of them)."""
    match spec.condition:
        case FanInCondition.ALL:
            return members
        case FanInCondition.ANY:
            return min(1, members)
        case FanInCondition.N_OF_M:
            return min(spec.n or members, members)


def outcome(group: FanIn) -> Outcome:
    answered = sum(m.status is MemberStatus.ANSWERED for m in group.members)
    still_open = sum(m.status is MemberStatus.OPEN for m in group.members)
    need = needed(group.spec, len(group.members))
    if answered >= need:
        return Outcome.MET
    if answered + still_open < need:
        return Outcome.UNMEETABLE
    return Outcome.PENDING


def record(group: FanIn, wait_id: str, status: MemberStatus, answer: JsonValue = None) -> FanIn:
    """The group after member ``wait_id`` closed with ``status``. Only an OPEN member
    changes: a member closes once, so a second answer can never overwrite the first."""
    members = [
        m.model_copy(update={"status": status, "answer": answer})
        if m.wait_id == wait_id and m.status is MemberStatus.OPEN
        else m
        for m in group.members
    ]
    return group.model_copy(update={"members": members})


def reissued(group: FanIn, wait_id: str, new: Wait) -> FanIn:
    """The group after member ``wait_id``'s request was reissued in the session's epoch
    (its next approval stage): the member, still OPEN, now waits on ``new``, so an answer
    to the request it replaced finds no member (stale, not a duplicate)."""
    members = [
        m.model_copy(update={"wait_id": new.wait_id, "correlation_id": new.correlation_id})
        if m.wait_id == wait_id and m.status is MemberStatus.OPEN
        else m
        for m in group.members
    ]
    return group.model_copy(update={"members": members})


def close_rest(group: FanIn) -> FanIn:
    """The group with every member still open cancelled (the group resolved)."""
    members = [
        m.model_copy(update={"status": MemberStatus.CANCELLED})
        if m.status is MemberStatus.OPEN
        else m
        for m in group.members
    ]
    return group.model_copy(update={"members": members})


def open_members(group: FanIn) -> list[FanInMember]:
    return [m for m in group.members if m.status is MemberStatus.OPEN]


def _missing(member: FanInMember) -> JsonValue:
    why = "deadline passed" if member.status is MemberStatus.EXPIRED else "condition resolved"
    return {"fan_in": {"outcome": member.status.value, "reason": why}}


def tool_results(group: FanIn, result: Outcome) -> list[tuple[str, JsonValue]]:
    """The tool results a resolved group delivers, as (tool_call_id, content), in the
    order the members were planned (never in the order their answers arrived).

    One tool's members: one aggregated result for its call. Several calls of one turn:
    each its own answer, or a ``fan_in`` notice saying why it has none."""
    if group.aggregate_call_id is not None:
        by_status: dict[str, list[str]] = {"expired": [], "cancelled": []}
        answers: dict[str, JsonValue] = {}
        failed: dict[str, JsonValue] = {}
        for m in group.members:
            if m.status is MemberStatus.ANSWERED:
                answers[m.label] = m.answer
            elif m.status is MemberStatus.FAILED:
                failed[m.label] = m.answer
            elif m.status.value in by_status:
                by_status[m.status.value].append(m.label)
        aggregated: JsonValue = {
            "condition": group.spec.condition.value,
            "needed": needed(group.spec, len(group.members)),
            "met": result is Outcome.MET,
            "answers": answers,
            "failed": failed,
            "expired": list(by_status["expired"]),
            "cancelled": list(by_status["cancelled"]),
        }
        return [(group.aggregate_call_id, aggregated)]
    return [
        (
            m.tool_call_id,
            m.answer if m.status in (MemberStatus.ANSWERED, MemberStatus.FAILED) else _missing(m),
        )
        for m in group.members
    ]


def form(
    spec: FanInSpec,
    waits: list[Wait],
    *,
    labels: list[str] | None = None,
    aggregate_call_id: str | None = None,
) -> tuple[FanIn, list[Wait]]:
    """A new group over ``waits`` (all OPEN), and the waits marked as its members."""
    group_id = new_group_id()
    names = labels if labels is not None else [w.tool_call_id for w in waits]
    group = FanIn(
        group_id=group_id,
        spec=spec,
        aggregate_call_id=aggregate_call_id,
        members=[
            FanInMember(
                wait_id=w.wait_id,
                correlation_id=w.correlation_id,
                tool_call_id=w.tool_call_id,
                label=label,
            )
            for w, label in zip(waits, names, strict=True)
        ],
    )
    return group, [w.model_copy(update={"group_id": group_id}) for w in waits]
