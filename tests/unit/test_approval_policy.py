"""The approval rules, pure: who may approve, and when enough have."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from torpor.approval.policy import AuthorityPolicy, Mode, Outcome, Quorum
from torpor.auth import hash_key, operator_for
from torpor.errors import Unauthenticated

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = AuthorityPolicy.model_validate(
    {
        "tiers": [{"up_to": 1000, "approvers": ["clerk"]}, {"approvers": ["fd"]}],
        "cost_centre_owners": {"CC-7": ["owner"]},
        "cost_centre_limit": 5000,
        "delegations": [
            {"delegate": "deputy", "for": "fd", "until": NOW + timedelta(days=1)},
        ],
    }
)


def authority(approver: str, amount: float, *, asked: list[str], at: datetime = NOW) -> bool:
    return POLICY.authority(approver, asked=asked, amount=amount, cost_centre="CC-7", now=at).ok


def test_amount_tiers() -> None:
    assert authority("clerk", 1000, asked=["clerk"])
    assert not authority("clerk", 1000.01, asked=["clerk"])
    assert authority("fd", 1_000_000, asked=["fd"])


def test_cost_centre_owners_up_to_their_limit() -> None:
    assert authority("owner", 5000, asked=["owner"])
    assert not authority("owner", 5001, asked=["owner"])
    other = POLICY.authority("owner", asked=["owner"], amount=10, cost_centre="CC-8", now=NOW)
    assert not other.ok


def test_a_delegation_counts_for_its_principal_until_it_ends() -> None:
    acting = POLICY.authority("deputy", asked=["fd"], amount=9000, cost_centre=None, now=NOW)
    assert acting.ok and acting.principal == "fd"
    assert not authority("deputy", 9000, asked=["fd"], at=NOW + timedelta(days=2))


def test_someone_not_asked_has_no_say() -> None:
    refused = POLICY.authority("fd", asked=["clerk"], amount=1, cost_centre=None, now=NOW)
    assert not refused.ok and "not an approver" in refused.why


@pytest.mark.parametrize(
    ("quorum", "votes", "outcome"),
    [
        (Quorum(mode=Mode.ALL), {"a": "approved", "b": "approved"}, Outcome.OPEN),
        (
            Quorum(mode=Mode.ALL),
            {"c": "approved", "a": "approved", "b": "approved"},
            Outcome.APPROVED,
        ),
        (Quorum(mode=Mode.ALL), {"b": "rejected"}, Outcome.REJECTED),
        (Quorum(mode=Mode.ANY), {"c": "approved"}, Outcome.APPROVED),
        (Quorum(mode=Mode.ANY), {"a": "rejected", "b": "rejected"}, Outcome.OPEN),
        (Quorum(mode=Mode.N_OF_M, required=2), {"x": "approved", "a": "approved"}, Outcome.OPEN),
        (
            Quorum(mode=Mode.N_OF_M, required=2),
            {"b": "approved", "a": "approved"},
            Outcome.APPROVED,
        ),
        (
            Quorum(mode=Mode.N_OF_M, required=2),
            {"a": "rejected", "b": "rejected"},
            Outcome.REJECTED,
        ),
    ],
)
def test_quorum(quorum: Quorum, votes: dict[str, str], outcome: Outcome) -> None:
    assert quorum.tally(["a", "b", "c"], votes) is outcome


def test_operator_keys_are_checked_and_never_named() -> None:
    key = "tpk_operator-key-0123456789"
    who = operator_for(f"Bearer {key}", [hash_key("tpk_other"), hash_key(key)])
    assert who.startswith("operator:") and key not in who
    for bad in (None, "Bearer tpk_wrong", "Basic abc", f"bearer{key}"):
        with pytest.raises(Unauthenticated):
            operator_for(bad, [hash_key(key)])


@pytest.mark.parametrize("mode", [Mode.ALL, Mode.N_OF_M])
def test_a_name_asked_twice_is_one_vote(mode: Mode) -> None:
    """An approver named twice (a stage's list, an operator's reassignment) votes once:
    their approval is not two of the quorum."""
    quorum = Quorum(mode=mode, required=2)
    asked = ["a", "b", "a"]
    assert quorum.needed(asked) == 2
    assert quorum.tally(asked, {"a": "approved"}) is Outcome.OPEN
    assert quorum.tally(asked, {"a": "approved", "b": "approved"}) is Outcome.APPROVED
    assert quorum.tally(asked, {"a": "rejected"}) is Outcome.REJECTED


def test_a_delegate_asked_in_their_own_right_may_still_act_for_their_principal() -> None:
    """The clerk (up to 1000) is asked beside fd, and acts for fd: above the clerk's own
    limit the vote counts for fd, whose authority it has, instead of being refused."""
    policy = POLICY.model_copy(
        update={
            "delegations": [
                *POLICY.delegations,
                *AuthorityPolicy.model_validate(
                    {"delegations": [{"delegate": "clerk", "for": "fd"}]}
                ).delegations,
            ]
        }
    )
    acting = policy.authority(
        "clerk", asked=["clerk", "fd"], amount=9000, cost_centre=None, now=NOW
    )
    assert acting.ok and acting.principal == "fd"
    own = policy.authority("clerk", asked=["clerk", "fd"], amount=500, cost_centre=None, now=NOW)
    assert own.ok and own.principal == "clerk"
    refused = POLICY.authority(
        "clerk", asked=["clerk", "fd"], amount=9000, cost_centre=None, now=NOW
    )
    assert not refused.ok and "no authority for 9000" in refused.why


@pytest.mark.parametrize("until", ["2026-12-31T00:00:00", datetime(2026, 12, 31)])
def test_a_delegation_end_without_a_time_zone_is_refused_when_the_policy_loads(
    until: object,
) -> None:
    """A TOML local date-time (no ``Z``) was kept naive: every answer of the delegate then
    failed its session's activation (naive compared with the aware clock), retried until
    the session was quarantined, the answers behind it in the inbox unread."""
    delegation = {"delegate": "deputy", "for": "fd", "until": until}
    with pytest.raises(ValidationError, match="timezone"):
        AuthorityPolicy.model_validate({"delegations": [delegation]})
