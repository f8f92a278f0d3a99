"""The gates an inbox event passes before it may change a session: each verdict."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tests.support.factories import NOW, busy_snapshot
from torpor.events import EventKind, InboxEvent
from torpor.gates import Verdict, classify, expired_waits, find_wait
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason, SessionSnapshot, Wait


def sleeping() -> tuple[SessionSnapshot, Wait]:
    snap = busy_snapshot(messages=4)
    return snap, snap.waits[0]


def answer(wait: Wait, *, at: datetime = NOW, **fields: Any) -> InboxEvent:
    """The OA system's answer to ``wait``, stamped with its epoch and step."""
    values: dict[str, Any] = {
        "kind": EventKind.CALLBACK,
        "session_id": "s",
        "source": "oa",
        "event_id": "evt-1",
        "type": "oa.approval.decided",
        "received_at": at,
        "data": {"approved": True},
    }
    values.update(fields)
    return InboxEvent.answering(wait, **values)


def test_an_event_for_the_open_wait_is_applied() -> None:
    snap, wait = sleeping()
    decision = classify(snap, answer(wait), processed=set())
    assert decision.verdict is Verdict.APPLY
    assert decision.wait == wait and decision.reason is None


def test_any_event_for_a_finished_session_is_late() -> None:
    snap, wait = sleeping()
    done = snap.model_copy(update={"state": SessionState.COMPLETED})
    decision = classify(done, answer(wait), processed=set())
    assert decision.verdict is Verdict.OBSERVE and decision.reason is ObservationReason.LATE


def test_an_event_for_an_unknown_correlation_id_is_stale() -> None:
    snap, wait = sleeping()
    other = wait.model_copy(update={"correlation_id": "c" * 32})
    decision = classify(snap, answer(other), processed=set())
    assert decision.verdict is Verdict.OBSERVE and decision.reason is ObservationReason.STALE
    assert decision.wait is None


def test_an_event_stamped_with_another_epoch_is_stale() -> None:
    snap, wait = sleeping()
    event = answer(wait).model_copy(update={"epoch": wait.epoch - 1})
    decision = classify(snap, event, processed=set())
    assert decision.verdict is Verdict.OBSERVE and decision.reason is ObservationReason.STALE


def test_an_event_stamped_with_another_step_is_stale() -> None:
    snap, wait = sleeping()
    event = answer(wait).model_copy(update={"step_id": "step-2"})
    decision = classify(snap, event, processed=set())
    assert decision.verdict is Verdict.OBSERVE and decision.reason is ObservationReason.STALE


def test_a_wait_left_from_an_older_epoch_of_the_session_is_stale() -> None:
    snap, wait = sleeping()
    moved_on = snap.model_copy(update={"epoch": wait.epoch + 1})
    decision = classify(moved_on, answer(wait), processed=set())
    assert decision.verdict is Verdict.OBSERVE and decision.reason is ObservationReason.STALE


def test_an_event_found_by_business_key_is_applied() -> None:
    snap, wait = sleeping()
    event = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=snap.session_id,
        source="oa",
        event_id="evt-bk",
        type="oa.approval.decided",
        received_at=NOW,
        business_key=wait.business_key,
    )
    assert find_wait(snap, event) == wait
    assert classify(snap, event, processed=set()).verdict is Verdict.APPLY


def test_a_redelivered_event_is_a_duplicate() -> None:
    snap, wait = sleeping()
    event = answer(wait)
    decision = classify(snap, event, processed={event.key})
    assert decision.verdict is Verdict.OBSERVE
    assert decision.reason is ObservationReason.DUPLICATE and decision.wait == wait


def test_an_event_of_a_type_the_wait_does_not_expect_is_unexpected() -> None:
    snap, wait = sleeping()
    decision = classify(snap, answer(wait, type="oa.comment.added"), processed=set())
    assert decision.verdict is Verdict.OBSERVE
    assert decision.reason is ObservationReason.UNEXPECTED


def test_an_event_from_a_source_the_wait_does_not_allow_is_unexpected() -> None:
    snap, wait = sleeping()
    decision = classify(snap, answer(wait, source="erp"), processed=set())
    assert decision.verdict is Verdict.OBSERVE
    assert decision.reason is ObservationReason.UNEXPECTED


def test_a_wait_that_names_no_source_is_answered_by_torpor_events_alone() -> None:
    snap, wait = sleeping()
    unnamed = wait.model_copy(update={"allowed_sources": [], "sources_declared": True})
    snap = snap.model_copy(update={"waits": [unnamed]})
    decision = classify(snap, answer(unnamed), processed=set())
    assert decision.verdict is Verdict.OBSERVE
    assert decision.reason is ObservationReason.UNEXPECTED
    link = answer(unnamed, source="capability", verified_by="capability")
    assert classify(snap, link, processed=set()).verdict is Verdict.APPLY


def test_a_wait_stored_by_0_1_keeps_its_rule_across_the_upgrade() -> None:
    # A 0.1 snapshot has no ``sources_declared``: an empty list meant "any source of the
    # tenant" then, and a wait already open when torpor is upgraded must stay answerable.
    snap, wait = sleeping()
    stored = wait.model_dump(mode="json")
    stored.pop("sources_declared", None)
    stored["allowed_sources"] = []
    legacy = Wait.model_validate(stored)
    snap = snap.model_copy(update={"waits": [legacy]})
    assert classify(snap, answer(legacy), processed=set()).verdict is Verdict.APPLY
    named = legacy.model_copy(update={"allowed_sources": ["erp"]})
    snap = snap.model_copy(update={"waits": [named]})
    assert classify(snap, answer(named), processed=set()).verdict is Verdict.OBSERVE


def test_polls_dispatch_failures_and_capability_calls_skip_the_type_and_source_filters() -> None:
    snap, wait = sleeping()
    for event in (
        answer(wait, kind=EventKind.POLL, source="torpor", type="poll"),
        answer(wait, kind=EventKind.DISPATCH_FAILED, source="torpor", type="failed"),
        answer(wait, source="anyone", type="any", verified_by="capability"),
    ):
        assert classify(snap, event, processed=set()).verdict is Verdict.APPLY, event.kind


def test_an_event_received_after_the_deadline_is_expired() -> None:
    snap, wait = sleeping()
    late = answer(wait, at=wait.deadline + timedelta(milliseconds=1))
    decision = classify(snap, late, processed=set())
    assert decision.verdict is Verdict.EXPIRED and decision.wait == wait
    on_time = answer(wait, at=wait.deadline)
    assert classify(snap, on_time, processed=set()).verdict is Verdict.APPLY


def test_expired_waits_are_those_whose_deadline_is_reached() -> None:
    snap, wait = sleeping()
    assert expired_waits(snap, now=wait.deadline - timedelta(seconds=1)) == []
    assert expired_waits(snap, now=wait.deadline) == [wait]
