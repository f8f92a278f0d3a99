"""A minimal agent and tool for runtime benchmarks: suspend once, record the wake-up.

The agent's second step writes the wall-clock time it began into Redis, so the driver
can compute resume latency (activation requested → agent step begins) across processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import redis

from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.tools import DispatchRequest, LongRunningTool, ToolContext, ToolSpec, WaitPlan

_redis: redis.Redis | None = None


def _client() -> redis.Redis:
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(
            os.environ.get("TORPOR_BENCH_REDIS", "redis://127.0.0.1:6379/0")
        )
    return _redis


class BenchAgent:
    name = "bench"
    version = "1"

    def initial_messages(self, input: Any, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if messages[-1].role == "tool":
            _client().rpush("torpor-bench:steps", f"{ctx.session_id} {time.time()}")
            return AgentTurn(Message(role="assistant", content="done"), result="done")
        call = ToolCall(id="call_wait", function=ToolCallFunction(name="wait_for_world"))
        return AgentTurn(Message(role="assistant", tool_calls=[call]))


class WaitForWorld(LongRunningTool):
    spec = ToolSpec(name="wait_for_world")
    answered_by = ("bench",)  # the benches' webhook source (a wait names who may answer)

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        return WaitPlan(
            action_key=f"bench:{ctx.session_id}", sla_s=86400, expected_duration_s=86400
        )

    async def dispatch(self, request: DispatchRequest) -> None:
        return None
