"""An ``ApprovalTool`` whose OA is a list: what it was sent and what was withdrawn."""

from __future__ import annotations

from typing import Any

from torpor.approval import ApprovalTool
from torpor.models import Wait
from torpor.tools import DispatchRequest

SENT: list[DispatchRequest] = []
WITHDRAWN: list[tuple[str, str]] = []  # (idempotency key, reason)


class OA(ApprovalTool):
    async def send(self, request: DispatchRequest) -> None:
        SENT.append(request)

    async def withdraw(self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str) -> None:
        WITHDRAWN.append((idempotency_key, reason))


def reset() -> None:
    SENT.clear()
    WITHDRAWN.clear()


def approval_agent(**options: Any) -> dict[str, Any]:
    """A plan agent that asks for one approval and finishes with its decision."""
    plan = {
        "steps": [
            {
                "id": "approve",
                "calls": [
                    {
                        "tool": "request_approval",
                        "args": {
                            "subject": "${input.doc}",
                            "amount": "${input.amount}",
                            "cost_centre": "${input.cc}",
                        },
                    }
                ],
                "branches": [
                    {"when": {"path": "results.approve.error", "op": "exists"}, "goto": "failed"}
                ],
            },
            {
                "id": "done",
                "finish": {
                    "decision": "${results.approve.status}",
                    "stages": "${results.approve.stages}",
                },
            },
            {"id": "failed", "finish": {"decision": "error"}},
        ]
    }
    path = "tests.runtime.approval_tools:OA"
    return {
        "factory": "torpor.agents.plan:PlanAgent",
        "options": {"plan": plan, "name": "approval", "version": "1"},
        "tools": [path],
        "tool_options": {path: {"answered_by": ["oa"], **options}},
    }


def approval_pair_agent(**options: Any) -> dict[str, Any]:
    """A plan agent that asks for two approvals in one turn (a fan-in group of two waits)
    and finishes with both decisions: ``big`` (5,000, above the threshold of a second
    stage) and ``small`` (500)."""
    docs = {"big": ("PR-BIG", 5000), "small": ("PR-SMALL", 500)}
    calls = [
        {
            "tool": "request_approval",
            "args": {"subject": doc, "amount": amount, "cost_centre": "CC-7"},
            "as": name,
        }
        for name, (doc, amount) in docs.items()
    ]
    plan = {
        "steps": [
            {"id": "approve", "calls": calls},
            {"id": "done", "finish": {name: f"${{results.{name}}}" for name in docs}},
        ]
    }
    path = "tests.runtime.approval_tools:OA"
    return {
        "factory": "torpor.agents.plan:PlanAgent",
        "options": {"plan": plan, "name": "approval-pair", "version": "1"},
        "tools": [path],
        "tool_options": {path: {"answered_by": ["oa"], **options}},
    }
