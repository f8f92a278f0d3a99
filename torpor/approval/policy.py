"""Who may approve a request, and when enough have: pure rules, no I/O, time a parameter.

Authority comes from the policy: amount *tiers* (who may approve up to which amount),
*cost-centre owners* (who may approve their own cost centre, up to a limit) and
*delegations* (someone acting for another, until a date). A delegate approves as the
person they act for: the vote is counted once per principal, whoever cast it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field


class _Policy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Tier(_Policy):
    """These approvers may approve amounts up to ``up_to`` (None: any amount)."""

    up_to: float | None = None
    approvers: list[str]


class Delegation(_Policy):
    """``delegate`` approves for ``principal`` until ``until`` (None: until withdrawn)."""

    delegate: str
    principal: str = Field(alias="for")
    # Aware, refused on load otherwise: a naive end (a TOML local date-time) cannot be
    # compared with the clock, and failed the session of every answer the delegate gave.
    until: AwareDatetime | None = None


@dataclass(frozen=True)
class Authority:
    ok: bool
    principal: str | None  # whom the vote counts for (the approver, or whom they act for)
    why: str


class AuthorityPolicy(_Policy):
    tiers: list[Tier] = Field(default_factory=list)
    cost_centre_owners: dict[str, list[str]] = Field(default_factory=dict)
    cost_centre_limit: float | None = None  # owners approve their own up to this amount
    delegations: list[Delegation] = Field(default_factory=list)

    @property
    def has_rules(self) -> bool:
        return bool(self.tiers or self.cost_centre_owners)

    def principals(self, approver: str, *, now: datetime) -> list[str]:
        """The approver, then everyone they act for at ``now``."""
        acting = [
            d.principal
            for d in self.delegations
            if d.delegate == approver and (d.until is None or now < d.until)
        ]
        return [approver, *acting]

    def may_approve(self, principal: str, *, amount: float, cost_centre: str | None) -> bool:
        if not self.has_rules:
            return True  # no rules: being asked is authority enough
        for tier in self.tiers:
            if principal in tier.approvers and (tier.up_to is None or amount <= tier.up_to):
                return True
        owners = self.cost_centre_owners.get(cost_centre or "", [])
        limit = self.cost_centre_limit
        return principal in owners and (limit is None or amount <= limit)

    def authority(
        self,
        approver: str,
        *,
        asked: list[str],
        amount: float,
        cost_centre: str | None,
        now: datetime,
    ) -> Authority:
        """Whether ``approver`` may decide a request put to ``asked``: as one of them (or
        acting for one of them), with authority for the amount. One asked in their own
        right without authority for it may still vote for a principal they act for."""
        refused: Authority | None = None
        for principal in self.principals(approver, now=now):
            if principal not in asked:
                continue
            if self.may_approve(principal, amount=amount, cost_centre=cost_centre):
                return Authority(True, principal, "")
            refused = refused or Authority(
                False, principal, f"{approver} has no authority for {amount:g} ({cost_centre})"
            )
        return refused or Authority(False, None, f"{approver} is not an approver of this request")


class Mode(StrEnum):
    ALL = "all"  # every approver asked
    ANY = "any"  # one of them
    N_OF_M = "n_of_m"  # ``required`` of them


class Outcome(StrEnum):
    OPEN = "open"
    APPROVED = "approved"
    REJECTED = "rejected"


class Quorum(_Policy):
    mode: Mode = Mode.ANY
    required: int = Field(default=1, ge=1)  # N, for n_of_m

    def needed(self, asked: list[str]) -> int:
        people = _distinct(asked)
        if self.mode is Mode.ALL:
            return len(people)
        if self.mode is Mode.ANY:
            return 1
        return min(self.required, len(people))

    def tally(self, asked: list[str], votes: dict[str, str]) -> Outcome:
        """Approved once enough principals approved; rejected once too many rejected for
        the rest to reach the quorum. Order does not matter: the votes are a set."""
        people = _distinct(asked)
        approved = sum(1 for p in people if votes.get(p) == "approved")
        rejected = sum(1 for p in people if votes.get(p) == "rejected")
        need = self.needed(people)
        if approved >= need:
            return Outcome.APPROVED
        if len(people) - rejected < need:
            return Outcome.REJECTED
        return Outcome.OPEN


def _distinct(asked: list[str]) -> list[str]:
    """Each person once: one named twice (in a stage's list, an operator's reassignment)
    has one vote, so is neither two of a quorum nor a second vote ``all`` waits for."""
    return list(dict.fromkeys(asked))
