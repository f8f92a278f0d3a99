"""An agent that never finishes (a model calling tools in a loop) is stopped by the
agent's ``max_steps``: each activation took at most 200 steps and was retried at once, so
the session ran, and resent its growing history to the model, for ever."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.harness import local_env
from tests.support.tools import agent_config
from torpor.agent import AgentContext, AgentTurn
from torpor.lifecycle import SessionState
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.ports import Reason


class Looper:
    """Calls the extract tool again at every step, however often it answered."""

    name = "looper"
    version = "1"

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        call = ToolCall(
            id=f"call-{ctx.step}",
            function=ToolCallFunction(name="extract_fields", arguments='{"doc": "PR-1"}'),
        )
        return AgentTurn(Message(role="assistant", tool_calls=[call]))

    def initial_messages(self, input: Any, ctx: AgentContext) -> list[Message]:
        return [Message(role="user", content="go")]


def looper() -> Looper:
    return Looper()


def agents(redis_url: str, prefix: str, **limit: int) -> dict[str, Any]:
    purchase = agent_config(redis_url, prefix)["purchase"]
    return {
        "looper": {
            **purchase,
            "factory": "tests.runtime.test_step_limit:looper",
            "options": {},
            "placement": "pooled",
            **limit,
        }
    }


async def test_an_agent_that_never_finishes_fails_at_its_step_limit(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    extra = {"agents": agents(redis_url, redis_prefix, max_steps=7)}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        sid = (await env.control.submit(tenant="acme", agent="looper", input={})).session_id
        snap = await env.load(sid)
        assert snap.state is SessionState.FAILED, snap.state
        assert snap.error is not None and snap.error.code == "step_limit"
        assert "agents.looper.max_steps" in snap.error.message
        assert snap.step == 7
        # Nothing left to retry it: another activation finds it ended.
        await env.control.activate(sid, reason=Reason.RETRY)
        assert (await env.load(sid)).step == 7


async def test_the_step_limit_spans_activations(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Past one activation's 200 rounds (the runaway checkpoint), the count goes on."""
    extra = {"agents": agents(redis_url, redis_prefix, max_steps=130)}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        sid = (await env.control.submit(tenant="acme", agent="looper", input={})).session_id
        snap = await env.load(sid)
        assert snap.state is SessionState.RUNNING and 0 < snap.step < 130  # checkpointed
        await env.control.activate(sid, reason=Reason.RETRY)
        snap = await env.load(sid)
        assert snap.state is SessionState.FAILED and snap.step == 130
