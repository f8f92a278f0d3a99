"""The demo's procurement agent: extract, ask the OA system, guard the ERP, order.

Plain tools an ML platform team would write: a sync extractor, a long-running approval
request whose answer comes back as a signed webhook days later, and a sync ERP call. The
tools talk HTTP to the simulated OA/ERP process (stdlib only, run off the event loop).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

from pydantic import JsonValue

from torpor.approval import ApprovalTool
from torpor.errors import ToolError
from torpor.models import DriftPolicy, GuardBaseline, Wait
from torpor.outbound import request_async
from torpor.tools import (
    DispatchRequest,
    ExternalState,
    LongRunningTool,
    PollOutcome,
    Tool,
    ToolContext,
    ToolSpec,
    WaitPlan,
)

PLAN: dict[str, Any] = {
    "steps": [
        {"id": "extract", "calls": [{"tool": "extract_fields", "args": {"document": "${input}"}}]},
        {
            "id": "approve",
            "calls": [
                {
                    "tool": "request_approval",
                    "args": {
                        "doc_id": "${results.extract.doc_id}",
                        "amount": "${results.extract.amount}",
                        "currency": "${results.extract.currency}",
                        "cost_centre": "${results.extract.cost_centre}",
                    },
                }
            ],
            "branches": [
                {"when": {"path": "results.approve.status", "value": "drift"}, "goto": "approve"},
                {
                    "when": {"path": "results.approve.status", "value": "rejected"},
                    "goto": "rejected",
                },
                {"when": {"path": "results.approve.error", "op": "exists"}, "goto": "failed"},
            ],
        },
        {
            "id": "order",
            "calls": [
                {
                    "tool": "create_purchase_order",
                    "args": {
                        "doc_id": "${results.extract.doc_id}",
                        "amount": "${results.extract.amount}",
                        "approver": "${results.approve.approver}",
                    },
                }
            ],
        },
        {
            "id": "done",
            "finish": {
                "decision": "approved",
                "doc_id": "${results.extract.doc_id}",
                "amount": "${results.extract.amount}",
                "po_number": "${results.order.po_number}",
            },
        },
        {
            "id": "rejected",
            "finish": {"decision": "rejected", "doc_id": "${results.extract.doc_id}"},
        },
        {"id": "failed", "finish": {"decision": "error", "doc_id": "${results.extract.doc_id}"}},
    ]
}


async def _call(method: str, url: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    try:
        response = await request_async(
            method,
            url,
            body=data,
            headers={"Content-Type": "application/json"},
            timeout_s=timeout_s,
        )
    except (OSError, http.client.HTTPException) as exc:
        raise ToolError(f"{method} {url} failed: {exc}", retryable=True) from exc
    if response.status == 404:
        return None
    if not response.ok:
        raise ToolError(
            f"{method} {url} answered {response.status}", retryable=response.status >= 500
        )
    return response.json()


class _Client:
    def __init__(self, simulator_url: str, timeout_s: float = 10.0) -> None:
        self.base = simulator_url.rstrip("/")
        self.timeout_s = timeout_s

    async def get(self, path: str, **query: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(query)}"
        return await _call("GET", url, None, self.timeout_s)

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        return await _call("POST", self.base + path, body, self.timeout_s)


class ExtractFields(Tool):
    spec = ToolSpec(
        name="extract_fields",
        description="Read a purchase request or invoice: vendor, total, currency, cost centre.",
        parameters={"type": "object", "properties": {"document": {"type": "object"}}},
    )
    version = "2"

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        doc = args.get("document")
        if not isinstance(doc, dict) or not isinstance(doc.get("lines"), list):
            raise ToolError("not a purchase document")
        total = sum(float(l["quantity"]) * float(l["unit_price"]) for l in doc["lines"])  # noqa: E741
        return {
            "doc_id": str(doc["doc_id"]),
            "kind": str(doc.get("kind", "purchase_request")),
            "vendor": str(doc["vendor"]),
            "amount": round(total, 2),
            "currency": str(doc.get("currency", "CNY")),
            "cost_centre": str(doc["cost_centre"]),
        }


SECOND_STAGE_ABOVE = 50_000.0  # amounts above this need the CFO too


class RequestApproval(ApprovalTool):
    """The built-in approval tool, talking to the simulated OA: the finance director
    approves; above 50,000 the CFO approves in a second stage; a reminder goes to the OA
    before the SLA; a director who does not answer is escalated to the CFO."""

    version = "4"
    can_poll = True
    checks_state = True

    def __init__(self, simulator_url: str, sla_s: float = 75.0, expected_s: float = 30.0) -> None:
        super().__init__(
            name="request_approval",
            description="Ask the finance director, in the OA system, to approve a purchase.",
            stages=[
                {"approvers": ["finance.director"]},
                {"approvers": ["cfo"], "above": SECOND_STAGE_ABOVE},
            ],
            policy={"tiers": [{"approvers": ["finance.director", "cfo"]}]},
            escalation=["cfo"],
            escalate_after_s=0.75 * sla_s,
            remind_before_s=[0.15 * sla_s],
            notify_url=simulator_url.rstrip("/") + "/oa/reminders",
            sla_s=sla_s,
            expected_duration_s=expected_s,
            answered_by=["oa"],  # the OA's webhooks; its capability links need no entry
        )
        self.oa = _Client(simulator_url)

    async def _budget(self, doc_id: str, cost_centre: str) -> str:
        state = await self.oa.get("/erp/budget", doc=doc_id, cost_centre=cost_centre)
        return str(state["version"])

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        doc_id, cost_centre = str(args["doc_id"]), str(args["cost_centre"])
        plan = await super().begin(
            {k: args.get(k) for k in ("doc_id", "amount", "currency", "cost_centre")}, ctx
        )
        return plan.model_copy(
            update={
                "expected_types": ["oa.approval.decided"],
                "guard": GuardBaseline(
                    version_tag=await self._budget(doc_id, cost_centre),
                    captured_at=ctx.now,
                    entities={"budget_owner": cost_centre},
                ),
                "on_drift": DriftPolicy.REPLAN,
            }
        )

    async def send(self, request: DispatchRequest) -> None:
        await self.oa.post(
            "/oa/requests",
            {
                **request.request,
                "session_id": request.session_id,
                "correlation_id": request.callback.correlation_id,
                "capability_url": request.callback.callback_url,
                "idempotency_key": request.idempotency_key,
                "deadline": request.deadline.isoformat(),
            },
        )

    async def poll(self, wait: Wait, *, tenant: str) -> PollOutcome | None:
        key = f"{tenant}:{wait.action_key}:{wait.epoch}"
        decision = await self.oa.get("/oa/decision", key=key)
        if not decision:
            return None
        return PollOutcome(event_id=f"poll:{key}", type="oa.approval.decided", data=decision)

    async def current_state(self, wait: Wait, *, tenant: str) -> ExternalState | None:
        request = wait.request
        version = await self._budget(str(request["doc_id"]), str(request["cost_centre"]))
        return ExternalState(version_tag=version)

    async def withdraw(self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str) -> None:
        await self.oa.post(
            "/oa/withdraw",
            {
                "doc_id": wait.request["doc_id"],
                "idempotency_key": idempotency_key,
                "reason": reason,
            },
        )


class CreatePurchaseOrder(Tool):
    spec = ToolSpec(
        name="create_purchase_order",
        description="Create the purchase order in the ERP (idempotent per call).",
        parameters={"type": "object", "properties": {"doc_id": {"type": "string"}}},
    )

    def __init__(self, simulator_url: str) -> None:
        self.erp = _Client(simulator_url)

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        order = await self.erp.post(
            "/erp/orders",
            {
                "doc_id": args["doc_id"],
                "amount": args.get("amount"),
                "approver": args.get("approver"),
                "idempotency_key": ctx.idempotency_key,
            },
        )
        return {"po_number": str(order["po_number"])}


def tools(
    simulator_url: str, sla_s: float = 75.0, expected_s: float = 30.0
) -> list[Tool | LongRunningTool]:
    """The demo agent's tool set (one import path in the agent's configuration)."""
    return [
        ExtractFields(),
        RequestApproval(simulator_url, sla_s=sla_s, expected_s=expected_s),
        CreatePurchaseOrder(simulator_url),
    ]
