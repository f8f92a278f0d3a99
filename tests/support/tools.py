"""Test tools that talk to a simulated OA/ERP world kept in Redis.

Every process of a test (the driver, session actors, pooled hosts, the reconciler) sees
the same world, so a test can count exactly how often each external side effect
happened, keyed by the idempotency key the tool was given.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis
from pydantic import JsonValue

from torpor.errors import ToolError
from torpor.models import DriftPolicy, FanInSpec, GuardBaseline, Wait
from torpor.tools import (
    DispatchRequest,
    ExternalState,
    LongRunningTool,
    MemberPlan,
    PollOutcome,
    Tool,
    ToolContext,
    ToolSpec,
    WaitPlan,
)


def _node() -> str | None:
    """The Ray node this tool runs on, if any (multi-node tests check the spread)."""
    import ray

    return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None


HOLD_LIMIT_S = 300.0


class World:
    def __init__(self, redis_url: str, prefix: str) -> None:
        self._redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        self.p = prefix + "world:"

    async def happened(self, kind: str, key: str, payload: dict[str, Any]) -> int:
        """One call into the external system. Like a real one, it applies an effect once
        per idempotency key (``entries``) however often it is called (``counts``)."""
        await self._redis.hsetnx(f"{self.p}{kind}", key, json.dumps(payload, default=str))
        return int(await self._redis.hincrby(f"{self.p}{kind}:count", key, 1))

    async def counts(self, kind: str) -> dict[str, int]:
        raw = await self._redis.hgetall(f"{self.p}{kind}:count")
        return {k: int(v) for k, v in raw.items()}

    async def entries(self, kind: str) -> dict[str, dict[str, Any]]:
        raw = await self._redis.hgetall(f"{self.p}{kind}")
        return {k: json.loads(v) for k, v in raw.items()}

    async def version(self, doc: str) -> str:
        return str(await self._redis.get(f"{self.p}version:{doc}") or "v1")

    async def set_version(self, doc: str, version: str) -> None:
        await self._redis.set(f"{self.p}version:{doc}", version)

    async def decide(self, doc: str, decision: dict[str, Any]) -> None:
        await self._redis.set(f"{self.p}decision:{doc}", json.dumps(decision))

    async def decision(self, doc: str) -> dict[str, Any] | None:
        raw = await self._redis.get(f"{self.p}decision:{doc}")
        return json.loads(raw) if raw else None

    async def gate(self, name: str) -> bool:
        return bool(await self._redis.exists(f"{self.p}gate:{name}"))

    async def open_gate(self, name: str) -> None:
        await self._redis.set(f"{self.p}gate:{name}", "1")

    async def close_gate(self, name: str) -> None:
        await self._redis.delete(f"{self.p}gate:{name}")

    async def close(self) -> None:
        await self._redis.aclose()


class ExtractFields(Tool):
    spec = ToolSpec(
        name="extract_fields",
        description="Extract vendor and amount from a purchase request.",
        parameters={"type": "object", "properties": {"doc": {"type": "string"}}},
    )

    def __init__(self, redis_url: str, prefix: str, hold: str | None = None) -> None:
        self.world = World(redis_url, prefix)
        self.hold = hold  # wait until this gate opens after the side effect (crash window)

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        doc = str(args.get("doc", ""))
        await self.world.happened("extract", ctx.idempotency_key, {"doc": doc, "node": _node()})
        if self.hold:
            # Held here, between the side effect and the checkpoint, until the test opens
            # the gate: the crash window the recovery tests aim at.
            await self.world.happened("held", doc, {})
            deadline = asyncio.get_running_loop().time() + HOLD_LIMIT_S
            while not await self.world.gate(self.hold):
                if asyncio.get_running_loop().time() > deadline:
                    raise ToolError(f"gate {self.hold!r} never opened")
                await asyncio.sleep(0.05)
        return {"doc": doc, "amount": args.get("amount", 100.0), "vendor": "Hengda Steel"}

    async def close(self) -> None:
        await self.world.close()


class RequestApproval(LongRunningTool):
    spec = ToolSpec(
        name="request_approval",
        description="Ask the OA system for a finance director's approval.",
        parameters={"type": "object", "properties": {"doc": {"type": "string"}}},
    )
    # Every source the tests configure as the OA system, in any signing scheme.
    answered_by = ("oa", "std", "ce", "gh", "stripe", "beta-erp")
    can_poll = True
    can_compensate = True
    checks_state = True

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        sla_s: float = 3600,
        expected_s: float = 600,
        on_drift: str = "replan",
        fail_dispatch: bool = False,
        compensate_gate: str | None = None,
        dispatch_gate: str | None = None,
    ) -> None:
        self.world = World(redis_url, prefix)
        self.sla_s = sla_s
        self.expected_s = expected_s
        self.on_drift = DriftPolicy(on_drift)
        self.fail_dispatch = fail_dispatch
        self.compensate_gate = compensate_gate  # undo fails (retryable) until this opens
        self.dispatch_gate = dispatch_gate  # the request fails (retryable) until this opens

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        doc = str(args["doc"])
        return WaitPlan(
            action_key=f"approve:{doc}",
            request={"doc": doc, "amount": args.get("amount")},
            business_key=doc,
            sla_s=self.sla_s,
            expected_duration_s=self.expected_s,
            expected_types=["oa.approval.decided"],
            guard=GuardBaseline(version_tag=await self.world.version(doc), captured_at=ctx.now),
            on_drift=self.on_drift,
        )

    async def dispatch(self, request: DispatchRequest) -> None:
        if self.fail_dispatch:
            raise ToolError("the OA system refused the request", retryable=False)
        if self.dispatch_gate and not await self.world.gate(self.dispatch_gate):
            await self.world.happened("dispatch_refused", request.idempotency_key, {})
            raise ToolError("the OA system is down for maintenance", retryable=True)
        doc = str(request.request["doc"])
        await self.world.happened(
            "dispatch",
            request.idempotency_key,
            {
                "doc": doc,
                "session_id": request.session_id,
                "correlation_id": request.callback.correlation_id,
                "token": request.callback.capability_token,
            },
        )

    async def poll(self, wait: Wait, *, tenant: str) -> PollOutcome | None:
        doc = str(wait.request["doc"])
        await self.world.happened("poll", wait.correlation_id, {"doc": doc})
        decision = await self.world.decision(doc)
        if decision is None:
            return None
        return PollOutcome(
            event_id=f"poll:{wait.correlation_id}", type="oa.approval.decided", data=decision
        )

    async def current_state(self, wait: Wait, *, tenant: str) -> ExternalState | None:
        return ExternalState(version_tag=await self.world.version(str(wait.request["doc"])))

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        if self.compensate_gate and not await self.world.gate(self.compensate_gate):
            raise ToolError("the OA system is down for maintenance", retryable=True)
        await self.world.happened(
            "compensate", idempotency_key, {"doc": wait.request["doc"], "reason": reason}
        )

    async def close(self) -> None:
        await self.world.close()


PLAN: dict[str, Any] = {
    "steps": [
        {
            "id": "extract",
            "calls": [
                {
                    "tool": "extract_fields",
                    # Most tests submit a document alone: its amount may be missing.
                    "args": {"doc": "${input.doc}", "amount": "${input.amount?}"},
                }
            ],
        },
        {
            "id": "approve",
            "calls": [
                {
                    "tool": "request_approval",
                    "args": {"doc": "${input.doc}", "amount": "${results.extract.amount}"},
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
        {"id": "done", "finish": {"decision": "${results.approve.status}", "doc": "${input.doc}"}},
        {"id": "rejected", "finish": {"decision": "rejected", "doc": "${input.doc}"}},
        {"id": "failed", "finish": {"decision": "error", "doc": "${input.doc}"}},
    ]
}


def agent_config(redis_url: str, prefix: str, **approval: Any) -> dict[str, Any]:
    """Settings fragment for the test agent ``purchase``."""
    common = {"redis_url": redis_url, "prefix": prefix}
    extract_options = {**common, **({"hold": approval.pop("hold")} if "hold" in approval else {})}
    placement = approval.pop("placement", "dedicated")
    return {
        "purchase": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": PLAN, "name": "purchase", "version": "1"},
            "tools": ["tests.support.tools:ExtractFields", "tests.support.tools:RequestApproval"],
            "tool_options": {
                "tests.support.tools:ExtractFields": extract_options,
                "tests.support.tools:RequestApproval": {**common, **approval},
            },
            "placement": placement,
        }
    }


class RequestQuotes(LongRunningTool):
    """Asks every vendor in ``args["vendors"]`` at once (a fan-in group under
    ``args["fan_in"]``); each request and each undo is recorded in the World, so the crash
    tests count them across processes."""

    spec = ToolSpec(name="request_quotes")
    answered_by = ("vendor",)
    can_compensate = True

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.world = World(redis_url, prefix)

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        return WaitPlan(
            action_key="quotes:rfq-1",
            members=[
                MemberPlan(label=v, action_key=f"quote:{v}", request={"vendor": v})
                for v in args["vendors"]
            ],
            fan_in=FanInSpec.model_validate(args.get("fan_in") or {}),
        )

    async def dispatch(self, request: DispatchRequest) -> None:
        await self.world.happened("dispatch", request.idempotency_key, dict(request.request))

    async def compensate(
        self, wait: Wait, *, tenant: str, reason: str, idempotency_key: str
    ) -> None:
        await self.world.happened("compensate", idempotency_key, {"reason": reason})

    async def close(self) -> None:
        await self.world.close()


def quotes_agent(redis_url: str, prefix: str, fan_in: dict[str, Any]) -> dict[str, Any]:
    """Settings fragment for the test agent ``quotes``: one call of ``request_quotes``."""
    plan = {
        "steps": [
            {
                "id": "q",
                "calls": [
                    {
                        "tool": "request_quotes",
                        "args": {"vendors": ["a", "b", "c"], "fan_in": fan_in},
                    }
                ],
            },
            {"id": "done", "finish": "${results.q}"},
        ]
    }
    path = "tests.support.tools:RequestQuotes"
    return {
        "quotes": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": plan, "name": "quotes", "version": "1"},
            "tools": [path],
            "tool_options": {path: {"redis_url": redis_url, "prefix": prefix}},
        }
    }
