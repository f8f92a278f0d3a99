"""The outbox: external requests recorded in the same commit as the state that needs them.

A long-running tool's request, a compensation and a notification are each written into
the snapshot as a PENDING entry by the commit that makes them necessary, and sent only
after that commit. If the process dies in between, the entry is still there and the next
activation (or the reconciler) sends it. Every send carries an idempotency key derived
from the entry, so a resend after a crash is deduplicated by the far side:
``tenant:action_key:epoch`` for a start (``Wait.idempotency_key``), the same with
``:compensate`` for an undo.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from torpor import tracing
from torpor.backoff import Backoff
from torpor.deadlines import call_out
from torpor.errors import DispatchImpossible, TorporError
from torpor.ids import new_entry_id
from torpor.models import (
    DispatchStatus,
    OutboxEntry,
    OutboxKind,
    SessionSnapshot,
    Wait,
)
from torpor.ports import CallbackRouter, Notifier
from torpor.tools import (
    CallbackRoute,
    DispatchRequest,
    LongRunningTool,
    ToolNotice,
    ToolRegistry,
)

MAX_DISPATCH_ATTEMPTS = 8
DISPATCH_BACKOFF_BASE_S = 2.0
DISPATCH_BACKOFF_CAP_S = 600.0
CALL_TIMEOUT_S = 60.0  # a dispatch or compensation whose tool sets no timeout_s
KEEP_SETTLED = 32  # settled entries kept in the snapshot for inspection


class BareRouter:
    """Correlation id only: for tools whose far side is given no URL or token."""

    def route(self, snapshot: SessionSnapshot, wait: Wait) -> CallbackRoute:
        return CallbackRoute(wait.correlation_id, None, None)


def start_entry(snapshot: SessionSnapshot, wait: Wait, *, now: datetime) -> OutboxEntry:
    return OutboxEntry(
        entry_id=new_entry_id(),
        kind=OutboxKind.START,
        tool_name=wait.tool_name,
        tool_call_id=wait.tool_call_id,
        correlation_id=wait.correlation_id,
        idempotency_key=wait.idempotency_key(snapshot.tenant),
        payload=wait.request,
        created_at=now,
    )


def compensate_entry(
    snapshot: SessionSnapshot, wait: Wait, *, reason: str, now: datetime
) -> OutboxEntry:
    key = wait.idempotency_key(snapshot.tenant)
    return OutboxEntry(
        entry_id=new_entry_id(),
        kind=OutboxKind.COMPENSATE,
        tool_name=wait.tool_name,
        tool_call_id=wait.tool_call_id,
        correlation_id=wait.correlation_id,
        idempotency_key=f"{key}:compensate",
        # The wait is gone from the snapshot once the session ends; the entry keeps a copy
        # so the undo can still be sent after a crash.
        payload={"reason": reason, "wait": wait.model_dump(mode="json")},
        created_at=now,
    )


def notify_entry(snapshot: SessionSnapshot, *, event: str, now: datetime) -> OutboxEntry:
    return OutboxEntry(
        entry_id=new_entry_id(),
        kind=OutboxKind.NOTIFY,
        idempotency_key=f"{snapshot.session_id}:{event}:{snapshot.epoch}",
        payload={"event": event},
        created_at=now,
    )


def notice_entry(snapshot: SessionSnapshot, notice: ToolNotice, *, now: datetime) -> OutboxEntry:
    """A tool's own signed notification (an approval reminder to the OA): a NOTIFY entry
    that names its receiver, sent through the deliveries like the submitter's notices."""
    return OutboxEntry(
        entry_id=new_entry_id(),
        kind=OutboxKind.NOTIFY,
        idempotency_key=f"{snapshot.session_id}:{notice.key}",
        payload={"event": notice.event, "url": notice.url, "data": notice.data},
        created_at=now,
    )


@dataclass(frozen=True)
class Sent:
    pass


@dataclass(frozen=True)
class RetryAt:
    at: datetime
    error: str


@dataclass(frozen=True)
class GaveUp:
    error: str


SendResult = Sent | RetryAt | GaveUp  # what one send attempt of an entry came to


def is_due(entry: OutboxEntry, now: datetime) -> bool:
    return entry.status is DispatchStatus.PENDING and (
        entry.next_attempt_at is None or entry.next_attempt_at <= now
    )


async def send(
    entry: OutboxEntry,
    snapshot: SessionSnapshot,
    *,
    tools: ToolRegistry,
    router: CallbackRouter,
    notifier: Notifier | None,
    now: datetime,
) -> SendResult:
    try:
        await _send(entry, snapshot, tools=tools, router=router, notifier=notifier)
    except Exception as exc:  # a tool's failure is data here: it decides retry vs give up
        error = f"{type(exc).__name__}: {exc}"[:500]
        retryable = exc.retryable if isinstance(exc, TorporError) else True
        if not retryable or entry.attempts + 1 >= MAX_DISPATCH_ATTEMPTS:
            return GaveUp(error)
        backoff = Backoff(base_s=DISPATCH_BACKOFF_BASE_S, cap_s=DISPATCH_BACKOFF_CAP_S, jitter=0.2)
        delay = backoff.delay_s(entry.attempts)
        return RetryAt(now + timedelta(seconds=delay), error)
    return Sent()


async def _send(
    entry: OutboxEntry,
    snapshot: SessionSnapshot,
    *,
    tools: ToolRegistry,
    router: CallbackRouter,
    notifier: Notifier | None,
) -> None:
    if entry.kind is OutboxKind.NOTIFY:
        if notifier is not None:
            await notifier.enqueue(snapshot, entry)
        return
    tool = tools.get(entry.tool_name or "")
    if not isinstance(tool, LongRunningTool):
        raise DispatchImpossible(f"tool {entry.tool_name!r} is not a long-running tool here")
    if entry.kind is OutboxKind.COMPENSATE:
        undone = Wait.model_validate(entry.payload["wait"])
        reason = str(entry.payload.get("reason", ""))
        if tool.can_compensate:
            await call_out(
                tool.compensate,
                undone,
                tenant=snapshot.tenant,
                reason=reason,
                idempotency_key=entry.idempotency_key,
                timeout_s=tool.timeout_s or CALL_TIMEOUT_S,
                what=f"{tool.spec.name}.compensate",
            )
        return
    wait = snapshot.wait_for(entry.correlation_id or "")
    if wait is None:
        return  # the wait closed before its request went out: nothing left to ask
    # A dispatch that overruns raises CallTimedOut (retryable): the entry stays PENDING and
    # is resent under the same business idempotency key, so the far side dedups it.
    with tracing.span("torpor.tool.dispatch", **{"torpor.tool": tool.spec.name}):
        await _dispatch(tool, snapshot, wait, entry, router)


async def _dispatch(
    tool: LongRunningTool,
    snapshot: SessionSnapshot,
    wait: Wait,
    entry: OutboxEntry,
    router: CallbackRouter,
) -> None:
    await call_out(
        tool.dispatch,
        DispatchRequest(
            session_id=snapshot.session_id,
            tenant=snapshot.tenant,
            tool_call_id=wait.tool_call_id,
            action_key=wait.action_key,
            idempotency_key=entry.idempotency_key,
            business_key=wait.business_key,
            request=wait.request,
            callback=router.route(snapshot, wait),
            deadline=wait.deadline,
            trace_id=snapshot.trace_id,
        ),
        timeout_s=tool.timeout_s or CALL_TIMEOUT_S,
        what=f"{tool.spec.name}.dispatch",
    )


def settle(entry: OutboxEntry, result: SendResult, *, now: datetime) -> OutboxEntry:
    """The entry after one send attempt."""
    attempts = entry.attempts + 1
    match result:
        case Sent():
            return entry.model_copy(
                update={
                    "status": DispatchStatus.DISPATCHED,
                    "attempts": attempts,
                    "dispatched_at": now,
                    "next_attempt_at": None,
                }
            )
        case RetryAt(at=at, error=error):
            return entry.model_copy(
                update={"attempts": attempts, "next_attempt_at": at, "last_error": error}
            )
        case GaveUp(error=error):
            # A start that gives up is answered to its wait (the agent decides what next);
            # anything else (an undo, a notice) has nobody to tell: a dead letter.
            status = (
                DispatchStatus.FAILED if entry.kind is OutboxKind.START else DispatchStatus.DEAD
            )
            return entry.model_copy(
                update={"status": status, "attempts": attempts, "last_error": error}
            )


def withdraw(entry: OutboxEntry, *, reason: str) -> OutboxEntry:
    """A start never to be sent (again): its session ended first. FAILED, so nothing sends
    it, and its last error says why (it was not a far side's refusal)."""
    return entry.model_copy(
        update={"status": DispatchStatus.FAILED, "next_attempt_at": None, "last_error": reason}
    )


def revive(entry: OutboxEntry) -> OutboxEntry:
    """A dead letter put back to PENDING for a fresh round of attempts (an operator's
    resend). Its idempotency key is unchanged, so the far side still dedups."""
    return entry.model_copy(
        update={"status": DispatchStatus.PENDING, "attempts": 0, "next_attempt_at": None}
    )


def trim(outbox: list[OutboxEntry]) -> list[OutboxEntry]:
    """Keep every pending entry and dead letter, and only the most recent settled ones."""
    settled = [e for e in outbox if e.status in (DispatchStatus.DISPATCHED, DispatchStatus.FAILED)]
    if len(settled) <= KEEP_SETTLED:
        return outbox
    drop = {e.entry_id for e in settled[: len(settled) - KEEP_SETTLED]}
    return [e for e in outbox if e.entry_id not in drop]
