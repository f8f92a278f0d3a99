"""Realistic test data: snapshots shaped like the sessions torpor really stores."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

from torpor.ids import new_correlation_id, new_session_id, new_trace_id, tool_call_key
from torpor.lifecycle import SessionState
from torpor.models import (
    AgentRef,
    GuardBaseline,
    Message,
    SessionSnapshot,
    ToolCall,
    ToolCallFunction,
    ToolLogEntry,
    Wait,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def snapshot(
    *,
    session_id: str | None = None,
    tenant: str = "acme",
    state: SessionState = SessionState.PENDING,
    messages: int = 2,
    now: datetime = NOW,
) -> SessionSnapshot:
    return SessionSnapshot(
        session_id=session_id or new_session_id(),
        tenant=tenant,
        agent=AgentRef(name="purchase", version="3"),
        state=state,
        trace_id=new_trace_id(),
        input={"doc": "PR-2026-0042", "amount": 18250.0},
        messages=conversation(messages),
        created_at=now,
        updated_at=now,
    )


def conversation(n: int, *, seed: int = 7) -> list[Message]:
    """``n`` messages of a purchase-approval agent talking to its tools."""
    rng = random.Random(seed)
    vendors = ["Hengda Steel", "Nordwind GmbH", "Acme Office Supply", "Blue River Logistics"]
    out = [Message(role="system", content="You process purchase requests for ACME Corp.")]
    i = 0
    while len(out) < n:
        i += 1
        vendor = rng.choice(vendors)
        amount = round(rng.uniform(100, 90000), 2)
        call_id = f"call_{i:04d}"
        out.append(
            Message(
                role="user",
                content=f"Purchase request PR-{i:05d} from {vendor} "
                f"for {amount} CNY, cost centre CC-{rng.randint(100, 999)}.",
            )
        )
        out.append(
            Message(
                role="assistant",
                content=None,
                tool_calls=[
                    ToolCall(
                        id=call_id,
                        function=ToolCallFunction(
                            name="extract_fields",
                            arguments=json.dumps(
                                {
                                    "doc": f"PR-{i:05d}",
                                    "fields": ["vendor", "amount", "cost_centre"],
                                }
                            ),
                        ),
                    )
                ],
            )
        )
        out.append(
            Message(
                role="tool",
                tool_call_id=call_id,
                content=json.dumps(
                    {
                        "vendor": vendor,
                        "amount": amount,
                        "currency": "CNY",
                        "cost_centre": f"CC-{rng.randint(100, 999)}",
                        "confidence": round(rng.random(), 3),
                    }
                ),
            )
        )
        out.append(
            Message(
                role="assistant",
                content=f"Extracted PR-{i:05d}: {vendor}, {amount} CNY. "
                "Requesting approval from the finance director.",
            )
        )
    return out[:n]


def busy_snapshot(messages: int = 200) -> SessionSnapshot:
    """A long-running session in the middle of a wait, with a tool log and variables."""
    snap = snapshot(messages=messages, state=SessionState.SUSPENDED)
    log = {
        tool_call_key(snap.session_id, i, f"call_{i:04d}"): ToolLogEntry(
            key=tool_call_key(snap.session_id, i, f"call_{i:04d}"),
            tool_name="extract_fields",
            tool_call_id=f"call_{i:04d}",
            step=i,
            result={"ok": True, "i": i},
            completed_at=NOW,
        )
        for i in range(40)
    }
    wait = Wait(
        wait_id="w_1a2b3c4d",
        correlation_id=new_correlation_id(),
        business_key="PR-00042",
        waiting_step_id="step-41",
        epoch=9,
        action_key="approve:PR-00042",
        tool_name="request_approval",
        tool_call_id="call_0042",
        expected_types=["oa.approval.decided"],
        allowed_sources=["oa"],
        opened_at=NOW,
        deadline=NOW + timedelta(days=2),
        expected_duration_s=3600,
        guard=GuardBaseline(
            version_tag="budget-v17", captured_at=NOW, entities={"approver": "u-17"}
        ),
        request={"doc": "PR-00042", "amount": 18250.0},
    )
    return snap.model_copy(
        update={
            "tool_log": log,
            "waits": [wait],
            "epoch": 9,
            "step": 41,
            "variables": {"plan": {"cursor": "approve", "visits": {"approve": 1}}},
        }
    )
