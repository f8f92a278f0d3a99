"""A cancel that arrives while the agent's step runs stops the calls it chose: the
session is cancelled and its long-running request never goes out. The loop looked for a
cancel only before asking the agent, so the turn's calls ran, the request was sent, and
only then was the session cancelled (and the request compensated)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import JsonValue

from tests.runtime import memory_env as me
from tests.runtime.memory_env import memory_env, reset
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.lifecycle import SessionState
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.session import loop

HOOK: list[Any] = []


class CancelledMidStep:
    name = "cm"
    version = "1"

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if any(m.role == "tool" for m in messages):
            return AgentTurn(Message(role="assistant", content="done"), result="done")
        for hook in HOOK:  # the client cancels while the LLM is thinking
            await hook(ctx.session_id)
        call = ToolCall(
            id="c1", function=ToolCallFunction(name="approve", arguments='{"doc":"D-1"}')
        )
        return AgentTurn(Message(role="assistant", content=None, tool_calls=[call]))


AGENTS = {
    "cm": {
        "factory": "tests.runtime.test_cancel_mid_step:CancelledMidStep",
        "tools": ["tests.runtime.memory_env:Approve"],
    }
}


async def test_a_cancel_received_during_a_step_sends_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read of the inbox is stale at once, as it is after an LLM step of seconds (this
    # agent's step takes a millisecond; no sleeping to make it look slow).
    monkeypatch.setattr(loop, "INBOX_FRESH_S", 0.0)
    async with memory_env(AGENTS) as env:
        reset()

        async def cancel(sid: str) -> None:
            await env.control.cancel(sid, tenant="acme")  # accepted; the session is busy

        HOOK[:] = [cancel]
        try:
            sid = (await env.control.submit(tenant="acme", agent="cm", input="x")).session_id
        finally:
            HOOK.clear()
        await env.runtime.activate(sid)
        snap = await env.load(sid)
        assert snap.state is SessionState.CANCELLED, snap.state
        assert me.PROBE.dispatched == [], (
            "the approval request went out after the cancel was accepted: "
            f"{[d.idempotency_key for d in me.PROBE.dispatched]}"
        )
