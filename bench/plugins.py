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


# --- the Ray work bench (bench_ray_work.py): one tool call, answered two ways ------------


class OneCallAgent:
    """Calls ``tool`` once; its next step records when it began (torpor-bench:steps:{tag})."""

    version = "1"

    def __init__(self, tool: str, tag: str) -> None:
        self.name, self.tool, self.tag = f"bench-{tag}", tool, tag

    def initial_messages(self, input: Any, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if messages[-1].role == "tool":
            _client().rpush(f"torpor-bench:steps:{self.tag}", f"{ctx.session_id} {time.time()}")
            return AgentTurn(Message(role="assistant", content="done"), result="done")
        call = ToolCall(id="call_work", function=ToolCallFunction(name=self.tool))
        return AgentTurn(Message(role="assistant", tool_calls=[call]))


def _ray_tool() -> Any:
    from actors.ray_work import WorkContext, ray_task_tool
    from torpor.work import Resources

    @ray_task_tool("ray_work", resources=Resources(num_cpus=0.25), expected_duration_s=3600)
    def work(args: dict[str, Any], ctx: WorkContext) -> dict[str, Any]:
        time.sleep(0.05)
        # The work's completion: the last thing it does before returning its result.
        _client().rpush("torpor-bench:done:ray", f"{ctx.session_id} {time.time()}")
        return {"ok": True}

    return work


ray_work = _ray_tool()


class WebhookWork(WaitForWorld):
    """The same call, answered by a signed webhook from the "work" source."""

    spec = ToolSpec(name="webhook_work")
    answered_by = ("work",)
