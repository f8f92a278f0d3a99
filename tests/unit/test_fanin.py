"""The pure fan-in logic: when a group's condition is decided, and what it answers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tests.support.factories import NOW
from torpor import fanin
from torpor.errors import ActionKeyIncomplete
from torpor.fanin import Outcome
from torpor.ids import new_correlation_id
from torpor.models import (
    ExpiryPolicy,
    FanIn,
    FanInCondition,
    FanInSpec,
    MemberStatus,
    SessionSnapshot,
    Wait,
)
from torpor.tools import MemberPlan, WaitPlan

A = MemberStatus.ANSWERED


def waits(count: int) -> list[Wait]:
    return [
        Wait(
            wait_id=f"w{i}",
            correlation_id=new_correlation_id(),
            waiting_step_id="1",
            epoch=1,
            action_key=f"quote:{i}",
            tool_name="quote",
            tool_call_id=f"call_{i}",
            opened_at=NOW,
            deadline=NOW,
            expected_duration_s=60,
        )
        for i in range(count)
    ]


def group(spec: FanInSpec, count: int = 3, aggregate: str | None = None) -> FanIn:
    made, _ = fanin.form(
        spec,
        waits(count),
        labels=[f"m{i}" for i in range(count)],
        aggregate_call_id=aggregate,
    )
    return made


def closing(g: FanIn, *steps: tuple[int, MemberStatus]) -> list[Outcome]:
    """The outcome after each member closes, in the order given."""
    seen = []
    for index, status in steps:
        g = fanin.record(g, f"w{index}", status, {"from": index})
        seen.append(fanin.outcome(g))
    return seen


ALL = FanInSpec()
ANY = FanInSpec(condition=FanInCondition.ANY)
TWO_OF_THREE = FanInSpec(condition=FanInCondition.N_OF_M, n=2)


def test_all_is_met_only_by_the_last_answer_in_any_order() -> None:
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        outcomes = closing(group(ALL), *[(i, A) for i in order])
        assert outcomes == [Outcome.PENDING, Outcome.PENDING, Outcome.MET]


def test_any_is_met_by_the_first_answer() -> None:
    assert closing(group(ANY), (2, A)) == [Outcome.MET]


def test_n_of_m_is_met_by_the_nth_answer() -> None:
    assert closing(group(TWO_OF_THREE), (1, A), (0, A)) == [Outcome.PENDING, Outcome.MET]


def test_missing_members_make_a_condition_unmeetable_as_soon_as_it_is_decided() -> None:
    expired, failed = MemberStatus.EXPIRED, MemberStatus.FAILED
    assert closing(group(ALL), (0, expired)) == [Outcome.UNMEETABLE]
    assert closing(group(TWO_OF_THREE), (0, expired), (1, failed)) == [
        Outcome.PENDING,
        Outcome.UNMEETABLE,
    ]
    # any: one missing member leaves the others to answer
    assert closing(group(ANY), (0, expired), (1, A)) == [Outcome.PENDING, Outcome.MET]


def test_a_member_closes_once_so_a_duplicate_never_overwrites_the_first_answer() -> None:
    g = fanin.record(group(ALL), "w0", A, "first")
    g = fanin.record(g, "w0", A, "second")
    g = fanin.record(g, "w0", MemberStatus.EXPIRED)
    assert g.members[0].answer == "first" and g.members[0].status is A
    assert fanin.outcome(g) is Outcome.PENDING


def test_a_reissued_member_stays_open_under_its_new_request() -> None:
    """Its next approval stage: the member now answers to the new wait's correlation id,
    so an answer to the one it replaced finds no member (stale, not a duplicate)."""
    g = fanin.record(group(ALL), "w1", A, "first")
    new = waits(1)[0].model_copy(update={"wait_id": "w0-2"})
    again = fanin.reissued(g, "w0", new)
    assert (again.members[0].wait_id, again.members[0].correlation_id) == (
        "w0-2",
        new.correlation_id,
    )
    assert again.members[0].status is MemberStatus.OPEN and again.members[1:] == g.members[1:]
    assert fanin.reissued(again, "w1", new) == again, "a closed member is not reopened"


def test_a_quorum_larger_than_the_group_needs_every_member() -> None:
    big = FanInSpec(condition=FanInCondition.N_OF_M, n=5)
    assert fanin.needed(big, 2) == 2
    assert closing(group(big, count=2), (0, A), (1, A)) == [Outcome.PENDING, Outcome.MET]


def test_per_call_results_follow_the_plan_order_not_the_arrival_order() -> None:
    g = group(TWO_OF_THREE)
    g = fanin.record(g, "w2", A, "quote-2")
    g = fanin.record(g, "w0", A, "quote-0")
    g = fanin.close_rest(g)
    results = fanin.tool_results(g, Outcome.MET)
    assert [call for call, _ in results] == ["call_0", "call_1", "call_2"]
    assert results[0][1] == "quote-0" and results[2][1] == "quote-2"
    assert results[1][1] == {"fan_in": {"outcome": "cancelled", "reason": "condition resolved"}}


def test_one_tool_gets_one_aggregated_result() -> None:
    g = group(ALL, aggregate="call_x")
    g = fanin.record(g, "w1", A, {"ok": 1})
    g = fanin.record(g, "w0", MemberStatus.EXPIRED)
    g = fanin.close_rest(g)
    [(call, content)] = fanin.tool_results(g, Outcome.UNMEETABLE)
    assert call == "call_x"
    assert content == {
        "condition": "all",
        "needed": 3,
        "met": False,
        "answers": {"m1": {"ok": 1}},
        "failed": {},
        "expired": ["m0"],
        "cancelled": ["m2"],
    }


def test_form_marks_every_wait_with_its_group() -> None:
    g, members = fanin.form(ANY, waits(2))
    assert {w.group_id for w in members} == {g.group_id}
    assert [m.label for m in g.members] == ["call_0", "call_1"]


def test_spec_needs_n_exactly_for_a_quorum() -> None:
    with pytest.raises(ValidationError):
        FanInSpec(condition=FanInCondition.N_OF_M)
    with pytest.raises(ValidationError):
        FanInSpec(condition=FanInCondition.ANY, n=2)
    assert FanInSpec().on_expiry is ExpiryPolicy.FAIL_ALL


def test_plan_members_need_distinct_keys_and_a_quorum_they_can_meet() -> None:
    def plan(*keys: str, n: int = 1) -> WaitPlan:
        return WaitPlan(
            action_key="quotes:1",
            members=[MemberPlan(label=k, action_key=k) for k in keys],
            fan_in=FanInSpec(condition=FanInCondition.N_OF_M, n=n),
        )

    assert len(plan("q:a", "q:b", n=2).members) == 2
    with pytest.raises(ValidationError):
        plan("q:a", "q:a")
    with pytest.raises(ValidationError):
        plan("q:a", "q:b", n=3)
    with pytest.raises(ValidationError):
        WaitPlan(action_key="quotes:1", fan_in=ANY)
    with pytest.raises(ActionKeyIncomplete):
        MemberPlan(label="a", action_key="quote:None")


def test_snapshot_without_fan_in_fields_still_loads() -> None:
    """A snapshot written before fan-in (no ``fan_ins``, no ``group_id``) loads as is."""
    from tests.support.factories import snapshot

    stored = snapshot().model_dump(mode="json")
    stored.pop("fan_ins", None)
    stored["waits"] = [
        {k: v for k, v in w.model_dump(mode="json").items() if k != "group_id"} for w in waits(2)
    ]
    loaded = SessionSnapshot.model_validate(stored)
    assert loaded.fan_ins == [] and all(w.group_id is None for w in loaded.waits)


def test_the_session_view_names_each_members_group() -> None:
    from tests.support.factories import snapshot
    from torpor.api import SessionOut

    group, members = fanin.form(ANY, waits(2))
    view = SessionOut.of(snapshot().model_copy(update={"waits": members, "fan_ins": [group]}))
    assert [w.group_id for w in view.waits] == [group.group_id] * 2


def test_a_session_without_groups_is_written_as_before_fan_in() -> None:
    """Byte-compatible single waits: no ``fan_ins``, no ``group_id`` in the stored JSON,
    so a node on the earlier version (which forbids unknown fields) still reads it."""
    from tests.support.factories import snapshot

    single = snapshot().model_copy(update={"waits": waits(1)})
    stored = json.loads(single.model_dump_json())
    assert "fan_ins" not in stored and "group_id" not in stored["waits"][0]
    assert SessionSnapshot.model_validate_json(single.model_dump_json()) == single
    group, members = fanin.form(ANY, waits(2))
    grouped = single.model_copy(update={"waits": members, "fan_ins": [group]})
    again = SessionSnapshot.model_validate_json(grouped.model_dump_json())
    assert again == grouped and again.waits[0].group_id == group.group_id
