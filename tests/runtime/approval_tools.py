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
