"""What happens to each demo document, decided up front from a seed.

The simulated OA/ERP systems and the demo's final check both derive every document's
story from this one pure function, so the demo knows the correct terminal state of each
session before it starts, and can prove it was reached.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from typing import Any


class Story(StrEnum):
    APPROVE = "approve"  # the finance director approves by signed webhook
    REJECT = "reject"  # … rejects (and a forged "approved" tries to get in first)
    DRIFT = "drift"  # the budget moves while the session sleeps: re-plan, re-approve
    CAPABILITY = "capability"  # approved through the capability link, no shared secret
    TIMEOUT = "timeout"  # nobody ever answers: the SLA ends it and the request is withdrawn
    CANCEL = "cancel"  # an operator cancels while it waits
    ESCALATE = "escalate"  # the director never answers: escalated to the CFO, who approves


@dataclass(frozen=True)
class DocPlan:
    doc_id: str
    story: Story
    delay_s: float  # after the decisions are released
    duplicate: bool  # the OA system delivers the decision twice
    late: bool  # and once more, much later, with a new event id
    forged: bool  # an attacker sends a forged "approved" first
    replay: bool  # an attacker replays a captured, valid request

    @property
    def decision(self) -> str | None:
        if self.story in (Story.APPROVE, Story.DRIFT, Story.CAPABILITY, Story.ESCALATE):
            return "approved"
        return "rejected" if self.story is Story.REJECT else None

    @property
    def expected_state(self) -> str:
        return {Story.TIMEOUT: "TIMED_OUT", Story.CANCEL: "CANCELLED"}.get(self.story, "COMPLETED")

    @property
    def expects_order(self) -> bool:
        return self.decision == "approved"

    @property
    def expects_compensation(self) -> bool:
        return self.story in (Story.TIMEOUT, Story.CANCEL, Story.ESCALATE)

    @property
    def expected_withdrawals(self) -> int:
        """An escalation withdraws the director's request; a timeout (after its own
        escalation) withdraws the CFO's too; a cancel withdraws the one open request."""
        return {Story.TIMEOUT: 2, Story.CANCEL: 1, Story.ESCALATE: 1}.get(self.story, 0)


def plan_documents(doc_ids: list[str], *, seed: int) -> dict[str, DocPlan]:
    n = len(doc_ids)
    counts = {
        Story.TIMEOUT: max(1, n // 12),
        Story.CANCEL: max(1, n // 25),
        Story.DRIFT: max(1, n // 8),
        Story.REJECT: max(1, n // 6),
        Story.CAPABILITY: max(1, n // 8),
        Story.ESCALATE: max(1, n // 12),
    }
    stories = [s for s, k in counts.items() for _ in range(k)]
    stories += [Story.APPROVE] * max(0, n - len(stories))
    rng = random.Random(seed)  # noqa: S311 - a reproducible story, not a secret
    rng.shuffle(stories)
    plans: dict[str, DocPlan] = {}
    for i, (doc_id, story) in enumerate(zip(doc_ids, stories[:n], strict=True)):
        answered = story in (Story.APPROVE, Story.REJECT, Story.DRIFT)
        plans[doc_id] = DocPlan(
            doc_id=doc_id,
            story=story,
            delay_s=round(rng.uniform(0.5, 6.0), 2),
            duplicate=answered and i % 3 == 0,
            late=answered and i % 5 == 1,
            forged=(story is Story.REJECT) or (answered and i % 7 == 2),
            replay=answered and i % 6 == 4,
        )
    return plans


def documents(limit: int | None = None) -> list[dict[str, Any]]:
    """The sample purchase requests and invoices shipped with torpor."""
    folder = resources.files("torpor").joinpath("demo_data")
    docs = [
        json.loads(entry.read_text(encoding="utf-8"))
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".json")
    ]
    return docs[:limit] if limit is not None else docs
