"""The outbox policy: entries and their idempotency keys, due-ness, settling, trimming, send."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from tests.support.factories import NOW, busy_snapshot
from torpor import outbox
from torpor.errors import ToolError
from torpor.models import DispatchStatus, OutboxEntry, OutboxKind, SessionSnapshot, Wait
from torpor.tools import (
    DispatchRequest,
    LongRunningTool,
    ToolContext,
    ToolRegistry,
    ToolSpec,
    WaitPlan,
)
from torpor.work import epoch_of


def sleeping() -> tuple[SessionSnapshot, Wait]:
    snap = busy_snapshot(messages=4)
    return snap, snap.waits[0]


class Approvals(LongRunningTool):
    """An in-test far side: records what it was sent, fails as told."""

    spec = ToolSpec(name="request_approval")
    can_compensate = True

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.sent: list[DispatchRequest] = []
        self.undone: list[tuple[str, str, str]] = []

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        raise NotImplementedError

    async def dispatch(self, request: DispatchRequest) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append(request)

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        self.undone.append((wait.wait_id, reason, idempotency_key))


async def send(entry: OutboxEntry, snap: SessionSnapshot, tool: Approvals) -> outbox.SendResult:
    return await outbox.send(
        entry,
        snap,
        tools=ToolRegistry([tool]),
        router=outbox.BareRouter(),
        notifier=None,
        now=NOW,
    )


# -- entries and their keys ---------------------------------------------------------------


def test_a_start_entry_carries_the_business_key_tenant_action_epoch() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    assert entry.kind is OutboxKind.START and entry.status is DispatchStatus.PENDING
    assert entry.idempotency_key == "acme:approve:PR-00042:9"
    assert entry.correlation_id == wait.correlation_id and entry.payload == wait.request
    assert entry.tool_name == wait.tool_name and entry.tool_call_id == wait.tool_call_id


def test_a_compensation_keeps_a_copy_of_the_wait_under_its_own_key() -> None:
    snap, wait = sleeping()
    entry = outbox.compensate_entry(snap, wait, reason="deadline passed", now=NOW)
    assert entry.kind is OutboxKind.COMPENSATE
    assert entry.idempotency_key == "acme:approve:PR-00042:9:compensate"
    assert entry.payload["reason"] == "deadline passed"
    assert Wait.model_validate(entry.payload["wait"]) == wait


def test_a_request_reissued_in_its_epoch_has_keys_of_its_own() -> None:
    """A fan-in member's next approval stage keeps the session's epoch: without the
    count of requests before it, the far side would dedupe it into the first stage's."""
    snap, wait = sleeping()
    again = wait.model_copy(update={"reissued": 1})
    assert outbox.start_entry(snap, again, now=NOW).idempotency_key == "acme:approve:PR-00042#1:9"
    undo = outbox.compensate_entry(snap, again, reason="escalated", now=NOW)
    assert undo.idempotency_key == "acme:approve:PR-00042#1:9:compensate"
    assert epoch_of(again.idempotency_key("acme")) == 9
    assert "reissued" not in wait.model_dump() and again.model_dump()["reissued"] == 1


def test_a_notification_is_keyed_by_session_event_and_epoch() -> None:
    snap, _ = sleeping()
    entry = outbox.notify_entry(snap, event="completed", now=NOW)
    assert entry.kind is OutboxKind.NOTIFY and entry.payload == {"event": "completed"}
    assert entry.idempotency_key == f"{snap.session_id}:completed:9"


def test_entries_made_again_get_new_ids_but_the_same_key() -> None:
    snap, wait = sleeping()
    first, again = (outbox.start_entry(snap, wait, now=NOW) for _ in range(2))
    assert first.entry_id != again.entry_id
    assert first.idempotency_key == again.idempotency_key


# -- due, settle, trim --------------------------------------------------------------------


def test_a_pending_entry_is_due_from_its_next_attempt_on() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    assert outbox.is_due(entry, NOW)
    later = entry.model_copy(update={"next_attempt_at": NOW + timedelta(seconds=5)})
    assert not outbox.is_due(later, NOW + timedelta(seconds=4))
    assert outbox.is_due(later, NOW + timedelta(seconds=5))


def test_a_settled_entry_is_never_due() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    for status in (DispatchStatus.DISPATCHED, DispatchStatus.FAILED):
        assert not outbox.is_due(entry.model_copy(update={"status": status}), NOW)


def test_settle_after_a_send_marks_the_entry_dispatched() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW).model_copy(
        update={"next_attempt_at": NOW, "attempts": 2}
    )
    sent = outbox.settle(entry, outbox.Sent(), now=NOW + timedelta(seconds=1))
    assert sent.status is DispatchStatus.DISPATCHED and sent.attempts == 3
    assert sent.dispatched_at == NOW + timedelta(seconds=1) and sent.next_attempt_at is None


def test_settle_after_a_retryable_failure_keeps_the_entry_pending_until_then() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    at = NOW + timedelta(seconds=30)
    retry = outbox.settle(entry, outbox.RetryAt(at, "boom"), now=NOW)
    assert retry.status is DispatchStatus.PENDING and retry.attempts == 1
    assert retry.next_attempt_at == at and retry.last_error == "boom"


def test_settle_after_giving_up_marks_the_entry_failed() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    failed = outbox.settle(entry, outbox.GaveUp("nope"), now=NOW)
    assert failed.status is DispatchStatus.FAILED and failed.attempts == 1
    assert failed.last_error == "nope"


def test_an_undo_or_notice_that_gives_up_is_a_dead_letter() -> None:
    snap, wait = sleeping()
    for entry in (
        outbox.compensate_entry(snap, wait, reason="timeout", now=NOW),
        outbox.notify_entry(snap, event="completed", now=NOW),
    ):
        dead = outbox.settle(entry, outbox.GaveUp("down"), now=NOW)
        assert dead.status is DispatchStatus.DEAD and dead.last_error == "down"
        assert not outbox.is_due(dead, NOW)
        revived = outbox.revive(dead)
        assert revived.status is DispatchStatus.PENDING and revived.attempts == 0
        assert revived.idempotency_key == entry.idempotency_key and outbox.is_due(revived, NOW)


def test_trim_never_drops_a_dead_letter() -> None:
    snap, wait = sleeping()
    dead = outbox.compensate_entry(snap, wait, reason="timeout", now=NOW).model_copy(
        update={"status": DispatchStatus.DEAD}
    )
    settled = [
        outbox.notify_entry(snap, event=f"e{i}", now=NOW).model_copy(
            update={"status": DispatchStatus.DISPATCHED}
        )
        for i in range(outbox.KEEP_SETTLED + 5)
    ]
    kept = outbox.trim([dead, *settled])
    assert kept[0] == dead and kept[1:] == settled[5:]


def test_trim_keeps_every_pending_entry_and_the_newest_settled_ones() -> None:
    snap, wait = sleeping()
    settled = [
        outbox.notify_entry(snap, event=f"e{i}", now=NOW).model_copy(
            update={"status": DispatchStatus.DISPATCHED}
        )
        for i in range(outbox.KEEP_SETTLED + 5)
    ]
    pending = outbox.start_entry(snap, wait, now=NOW)
    entries = [settled[0], pending, *settled[1:]]
    kept = outbox.trim(entries)
    assert pending in kept
    assert [e for e in kept if e is not pending] == settled[5:]
    assert kept.index(pending) == 0  # order is kept


def test_trim_leaves_a_short_outbox_alone() -> None:
    snap, _ = sleeping()
    entries = [
        outbox.notify_entry(snap, event=f"e{i}", now=NOW).model_copy(
            update={"status": DispatchStatus.FAILED}
        )
        for i in range(outbox.KEEP_SETTLED)
    ]
    assert outbox.trim(entries) == entries


# -- send ---------------------------------------------------------------------------------


async def test_a_start_is_dispatched_with_its_key_and_route() -> None:
    snap, wait = sleeping()
    tool = Approvals()
    entry = outbox.start_entry(snap, wait, now=NOW)
    assert await send(entry, snap, tool) == outbox.Sent()
    [request] = tool.sent
    assert request.idempotency_key == "acme:approve:PR-00042:9"
    assert request.callback.correlation_id == wait.correlation_id
    assert request.deadline == wait.deadline and request.tool_call_id == wait.tool_call_id


async def test_a_start_whose_wait_closed_is_sent_nowhere() -> None:
    snap, wait = sleeping()
    tool = Approvals()
    entry = outbox.start_entry(snap, wait, now=NOW)
    closed = snap.model_copy(update={"waits": []})
    assert await send(entry, closed, tool) == outbox.Sent()
    assert tool.sent == []


async def test_a_compensation_undoes_the_copied_wait() -> None:
    snap, wait = sleeping()
    tool = Approvals()
    entry = outbox.compensate_entry(snap, wait, reason="cancelled", now=NOW)
    assert await send(entry, snap.model_copy(update={"waits": []}), tool) == outbox.Sent()
    assert tool.undone == [(wait.wait_id, "cancelled", "acme:approve:PR-00042:9:compensate")]


async def test_a_retryable_failure_is_retried_after_a_backoff() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW).model_copy(update={"attempts": 3})
    result = await send(entry, snap, Approvals(fail=ConnectionError("reset")))
    assert isinstance(result, outbox.RetryAt)
    base = outbox.DISPATCH_BACKOFF_BASE_S * 2**3
    assert NOW + timedelta(seconds=base * 0.8) <= result.at <= NOW + timedelta(seconds=base * 1.2)
    assert result.error == "ConnectionError: reset"


async def test_a_permanent_failure_gives_up_at_once() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    result = await send(entry, snap, Approvals(fail=ToolError("no such vendor")))
    assert isinstance(result, outbox.GaveUp) and "no such vendor" in result.error


async def test_a_tool_error_marked_retryable_is_retried() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW)
    result = await send(entry, snap, Approvals(fail=ToolError("busy", retryable=True)))
    assert isinstance(result, outbox.RetryAt)


async def test_the_last_attempt_gives_up() -> None:
    snap, wait = sleeping()
    last = outbox.MAX_DISPATCH_ATTEMPTS - 1
    entry = outbox.start_entry(snap, wait, now=NOW).model_copy(update={"attempts": last})
    result = await send(entry, snap, Approvals(fail=ConnectionError("reset")))
    assert isinstance(result, outbox.GaveUp)


async def test_a_tool_missing_here_is_a_permanent_failure() -> None:
    snap, wait = sleeping()
    entry = outbox.start_entry(snap, wait, now=NOW).model_copy(update={"tool_name": "gone"})
    result = await send(entry, snap, Approvals())
    assert isinstance(result, outbox.GaveUp) and "gone" in result.error


class Hanging(Approvals):
    """A far side that never answers: every call to it hangs."""

    timeout_s = 0.01

    async def dispatch(self, request: DispatchRequest) -> None:
        await asyncio.Event().wait()

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        await asyncio.Event().wait()


async def test_a_hung_dispatch_or_compensation_is_retried_under_the_same_key() -> None:
    snap, wait = sleeping()
    for entry in (
        outbox.start_entry(snap, wait, now=NOW),
        outbox.compensate_entry(snap, wait, reason="cancelled", now=NOW),
    ):
        result = await asyncio.wait_for(send(entry, snap, Hanging()), 5.0)
        assert isinstance(result, outbox.RetryAt), "bounded, and its outcome unknown: resent"
        assert "CallTimedOut" in result.error
        settled = outbox.settle(entry, result, now=NOW)
        assert settled.status is DispatchStatus.PENDING
        assert settled.idempotency_key == entry.idempotency_key
