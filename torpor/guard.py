"""The State Invalidation Guard: has the world drifted while the session slept?

A session that asked for approval of a 40,000 purchase against budget version 17 must
not act on "approved" if the budget is at version 19 now, the quote it relied on expired,
or the approver lost their authority meanwhile. On wake the guard compares the wait's
baseline with the current external state; the wait's ``on_drift`` policy decides what
happens on failure (re-plan, compensate, block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import JsonValue

from torpor.models import GuardBaseline, Wait
from torpor.tools import ExternalState


@dataclass(frozen=True)
class GuardVerdict:
    ok: bool
    reasons: list[str] = field(default_factory=list)

    def notice(self, wait: Wait, current: ExternalState | None) -> dict[str, JsonValue]:
        """The drift notice a re-planning agent receives as the tool's result."""
        baseline = wait.guard
        return {
            "status": "drift",
            "policy": wait.on_drift.value,
            "reasons": list(self.reasons),
            "baseline": {
                "version_tag": baseline.version_tag if baseline else None,
                "fingerprint": baseline.fingerprint if baseline else None,
            },
            "current": {
                "version_tag": current.version_tag if current else None,
                "fingerprint": current.fingerprint if current else None,
            },
        }


OK = GuardVerdict(True)


def evaluate(
    baseline: GuardBaseline | None,
    current: ExternalState | None,
    *,
    now: datetime,
    asked: bool = False,
    unchecked: bool = False,
) -> GuardVerdict:
    """Compare what the session relied on with what holds now. ``asked``: the tool was
    asked for the current state (its ``current_state`` ran); None is then its answer.
    ``unchecked``: the baseline names state that no tool can report (a tool that neither
    says it ``checks_state`` nor has a ``current_state``, or one no longer configured)."""
    if baseline is None:
        return OK
    reasons: list[str] = []
    if unchecked:
        # Passing would apply the answer as if the world had been compared and found
        # unchanged: a baseline nobody can check fails closed, as a gone state does.
        reasons.append("no tool can report the external state the baseline names")
    if baseline.ttl_s is not None and now > baseline.captured_at + timedelta(
        seconds=baseline.ttl_s
    ):
        reasons.append(f"baseline older than its {baseline.ttl_s:g}s TTL")
    if current is None and asked:
        # Asked, the tool had nothing to compare with the baseline: the entity is gone
        # (a deleted budget, a withdrawn quote). Passing would act on an answer about a
        # world that no longer exists: the guard fails closed.
        reasons.append("the external state is gone: nothing to compare with the baseline")
    if current is not None:
        if baseline.version_tag is not None and current.version_tag != baseline.version_tag:
            reasons.append(f"version changed from {baseline.version_tag} to {current.version_tag}")
        if baseline.fingerprint is not None and current.fingerprint != baseline.fingerprint:
            reasons.append("fingerprint of the external state changed")
        for entity, why in sorted(current.invalid_entities.items()):
            if entity in baseline.entities:
                reasons.append(f"{entity} {baseline.entities[entity]} no longer valid: {why}")
    return GuardVerdict(not reasons, reasons)


def needs_state(wait: Wait) -> bool:
    """Only ask the external system when the baseline has something to compare."""
    g = wait.guard
    return g is not None and (
        g.version_tag is not None or g.fingerprint is not None or bool(g.entities)
    )
