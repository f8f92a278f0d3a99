"""The State Invalidation Guard: each reason a baseline no longer holds, and the notice."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from tests.support.factories import NOW, busy_snapshot
from torpor import guard
from torpor.models import DriftPolicy, GuardBaseline
from torpor.tools import ExternalState, WaitPlan

BASELINE = GuardBaseline(
    version_tag="budget-v17",
    fingerprint="sha256:aa",
    captured_at=NOW,
    ttl_s=3600,
    entities={"approver": "u-17"},
)
SAME = ExternalState(version_tag="budget-v17", fingerprint="sha256:aa")


def test_no_baseline_always_holds() -> None:
    assert guard.evaluate(None, ExternalState(version_tag="x"), now=NOW).ok


def test_an_unchanged_world_within_the_ttl_holds() -> None:
    verdict = guard.evaluate(BASELINE, SAME, now=NOW + timedelta(seconds=3600))
    assert verdict.ok and verdict.reasons == []


def test_a_baseline_past_its_ttl_is_drift_even_when_nothing_changed() -> None:
    verdict = guard.evaluate(BASELINE, SAME, now=NOW + timedelta(seconds=3601))
    assert not verdict.ok
    assert verdict.reasons == ["baseline older than its 3600s TTL"]


def test_a_changed_version_tag_is_drift() -> None:
    current = SAME.model_copy(update={"version_tag": "budget-v19"})
    verdict = guard.evaluate(BASELINE, current, now=NOW)
    assert not verdict.ok
    assert verdict.reasons == ["version changed from budget-v17 to budget-v19"]


def test_a_changed_fingerprint_is_drift() -> None:
    current = SAME.model_copy(update={"fingerprint": "sha256:bb"})
    verdict = guard.evaluate(BASELINE, current, now=NOW)
    assert verdict.reasons == ["fingerprint of the external state changed"]


def test_an_invalid_entity_the_baseline_relied_on_is_drift() -> None:
    current = SAME.model_copy(update={"invalid_entities": {"approver": "left the company"}})
    verdict = guard.evaluate(BASELINE, current, now=NOW)
    assert verdict.reasons == ["approver u-17 no longer valid: left the company"]


def test_no_current_state_from_a_tool_that_was_asked_is_drift() -> None:
    verdict = guard.evaluate(BASELINE, None, now=NOW, asked=True)
    assert not verdict.ok
    assert verdict.reasons == ["the external state is gone: nothing to compare with the baseline"]


def test_no_current_state_when_nothing_was_asked_compares_nothing() -> None:
    assert guard.evaluate(BASELINE, None, now=NOW).ok


def test_an_invalid_entity_the_baseline_did_not_rely_on_is_ignored() -> None:
    current = SAME.model_copy(update={"invalid_entities": {"supplier": "blacklisted"}})
    assert guard.evaluate(BASELINE, current, now=NOW).ok


def test_every_failing_check_is_reported() -> None:
    current = ExternalState(
        version_tag="budget-v19", fingerprint="sha256:bb", invalid_entities={"approver": "gone"}
    )
    verdict = guard.evaluate(BASELINE, current, now=NOW + timedelta(days=1))
    assert len(verdict.reasons) == 4 and not verdict.ok


def test_without_current_state_only_the_ttl_is_checked() -> None:
    assert guard.evaluate(BASELINE, None, now=NOW).ok
    assert not guard.evaluate(BASELINE, None, now=NOW + timedelta(days=1)).ok


def test_the_external_system_is_asked_only_when_there_is_something_to_compare() -> None:
    wait = busy_snapshot(messages=4).waits[0]
    assert guard.needs_state(wait)  # version tag and an entity
    ttl_only = GuardBaseline(captured_at=NOW, ttl_s=60)
    assert not guard.needs_state(wait.model_copy(update={"guard": ttl_only}))
    assert not guard.needs_state(wait.model_copy(update={"guard": None}))
    by_fingerprint = GuardBaseline(captured_at=NOW, fingerprint="sha256:aa")
    assert guard.needs_state(wait.model_copy(update={"guard": by_fingerprint}))
    by_entity = GuardBaseline(captured_at=NOW, entities={"approver": "u-17"})
    assert guard.needs_state(wait.model_copy(update={"guard": by_entity}))


def test_the_drift_notice_names_the_policy_the_reasons_and_both_states() -> None:
    wait = busy_snapshot(messages=4).waits[0].model_copy(update={"on_drift": DriftPolicy.REPLAN})
    current = ExternalState(version_tag="budget-v19")
    verdict = guard.evaluate(wait.guard, current, now=NOW)
    assert verdict.notice(wait, current) == {
        "status": "drift",
        "policy": "replan",
        "reasons": ["version changed from budget-v17 to budget-v19"],
        "baseline": {"version_tag": "budget-v17", "fingerprint": None},
        "current": {"version_tag": "budget-v19", "fingerprint": None},
    }


def test_a_baseline_no_tool_can_check_fails_closed() -> None:
    verdict = guard.evaluate(BASELINE, None, now=NOW, unchecked=True)
    assert not verdict.ok
    assert verdict.reasons == ["no tool can report the external state the baseline names"]


@pytest.mark.parametrize("where", ["plan", "member"])
def test_a_baseline_stamped_without_a_time_zone_is_refused_when_planned(where: str) -> None:
    """``captured_at=datetime.now()`` passed every check until the wake, where comparing
    it with the clock raised TypeError: retried to quarantine, never a clear error."""
    naive = GuardBaseline(version_tag="v1", captured_at=datetime(2026, 12, 6, 9, 0))
    plan: dict[str, Any] = {"action_key": "approve:PR-1", "request": {}}
    if where == "plan":
        plan["guard"] = naive
    else:
        plan["members"] = [{"label": "a", "action_key": "approve:PR-1:a", "guard": naive}]
    with pytest.raises(ValidationError, match="needs a time zone"):
        WaitPlan.model_validate(plan)
    aware = naive.model_copy(update={"captured_at": NOW})
    WaitPlan.model_validate(
        {**plan, "guard": aware}
        if where == "plan"
        else plan | {"members": [{"label": "a", "action_key": "approve:PR-1:a", "guard": aware}]}
    )
