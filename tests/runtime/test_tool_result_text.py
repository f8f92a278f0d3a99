"""A sync tool's result that no snapshot can hold is a tool error the agent sees; a
result that is a str reaches the agent as that str."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import JsonValue

from tests.runtime.memory_env import memory_env, plan_agent
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.lifecycle import SessionState
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.tools import ToolContext, sync_tool


def _half_emoji(args: dict[str, Any], ctx: ToolContext) -> JsonValue:
    """What a file read with ``errors="surrogateescape"`` hands back: no Unicode text."""
    return {"title": b"caf\xe9".decode("utf-8", errors="surrogateescape")}


half_emoji = sync_tool("half_emoji")(_half_emoji)


def _a_datetime(args: dict[str, Any], ctx: ToolContext) -> JsonValue:
    """A result JSON has no form for (its ToolLogEntry refused it, escaping the call)."""
    return {"at": datetime.now(UTC)}  # type: ignore[dict-item]


a_datetime = sync_tool("half_emoji")(_a_datetime)  # the name the plan calls

PLAN = {
    "steps": [
        {"id": "read", "calls": [{"tool": "half_emoji"}], "on_error": "failed"},
        {"id": "done", "finish": "${results.read}"},
        {"id": "failed", "finish": {"failed": "${results.read.error.code}"}},
    ]
}


@pytest.mark.parametrize("tool", ["half_emoji", "a_datetime"])
async def test_a_result_no_snapshot_can_hold_is_a_tool_error(tool: str) -> None:
    """It was logged and put in a tool message as it was; the snapshot could not be
    encoded, the commit raised, and every replay ran the tool again and failed at the
    same commit: the session RUNNING for good."""
    tools: dict[str, dict[str, Any]] = {f"tests.runtime.test_tool_result_text:{tool}": {}}
    async with memory_env({"p": plan_agent(PLAN, tools)}) as env:
        sid = await env.submit("p")
        snap = await env.load(sid)
        assert snap.state is SessionState.COMPLETED, (snap.state, snap.error)
        assert snap.result == {"failed": "tool_error"}


def _echo(args: dict[str, Any], ctx: ToolContext) -> JsonValue:
    return args["text"]  # type: ignore[no-any-return]


echo = sync_tool("echo")(_echo)

ECHO_PLAN = {
    "steps": [
        {"id": "echo", "calls": [{"tool": "echo", "args": {"text": "${input}"}}]},
        {"id": "done", "finish": {"echoed": "${results.echo}"}},
    ]
}


@pytest.mark.parametrize(
    "text", ["123", "true", "null", "NaN", "1e3", '"quoted"', '{"a": 1}', "[1]", " 7 "]
)
async def test_a_str_result_that_reads_as_json_stays_a_str(text: str) -> None:
    """The tool message carried the str as its text, and the plan agent read that text
    as JSON: the tool's "123" came back as the number 123, "true" as True, "null" as no
    result at all."""
    tools: dict[str, dict[str, Any]] = {"tests.runtime.test_tool_result_text:echo": {}}
    async with memory_env({"p": plan_agent(ECHO_PLAN, tools)}) as env:
        snap = await env.load(await env.submit("p", text))
        assert snap.state is SessionState.COMPLETED, (snap.state, snap.error)
        assert snap.result == {"echoed": text}


async def test_a_str_result_that_is_plain_text_is_sent_as_it_is() -> None:
    """What a model reads: the tool's own text, not a JSON string literal of it."""
    tools: dict[str, dict[str, Any]] = {"tests.runtime.test_tool_result_text:echo": {}}
    async with memory_env({"p": plan_agent(ECHO_PLAN, tools)}) as env:
        snap = await env.load(await env.submit("p", 'PO 17 "approved"'))
        [tool] = [m for m in snap.messages if m.role == "tool"]
        assert tool.content == 'PO 17 "approved"'
        assert snap.result == {"echoed": 'PO 17 "approved"'}


async def test_a_str_result_nested_deeper_than_python_parses_stays_a_str() -> None:
    """Valid JSON nested deeper than Python's parser goes raises RecursionError, not
    ValueError: it escaped the check that decides how a str result is sent, and the
    plan agent's read of the tool message, and the step failed at every replay."""
    deep = "[" * 100_000 + "]" * 100_000
    tools: dict[str, dict[str, Any]] = {"tests.runtime.test_tool_result_text:echo": {}}
    async with memory_env({"p": plan_agent(ECHO_PLAN, tools)}) as env:
        snap = await env.load(await env.submit("p", deep))
        assert snap.state is SessionState.COMPLETED, (snap.state, snap.error)
        assert snap.result == {"echoed": deep}


class Reader:
    """An agent that reads tool messages as text, as a model does: it calls ``echo`` once
    and finishes with the tool message's content exactly as it was given."""

    name, version = "reader", "1"

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        answers = [m.content for m in messages if m.role == "tool"]
        if answers:
            return AgentTurn(Message(role="assistant", content="done"), result=answers[0])
        call = ToolCall(
            id="call_echo",
            function=ToolCallFunction(name="echo", arguments=json.dumps({"text": ctx.input})),
        )
        return AgentTurn(Message(role="assistant", tool_calls=[call]))

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)


@pytest.mark.parametrize("text", ['{"temperature": 20}', "[1, 2]", "123", "plain text"])
async def test_a_model_reads_a_str_result_as_the_tool_wrote_it(text: str) -> None:
    """A tool that returns JSON text (``json.dumps(...)``, common) reached every agent's
    model quoted and escaped once str results were encoded for the plan agent's sake:
    only an agent that reads tool messages back as JSON gets them quoted."""
    agents = {
        "r": {
            "factory": "tests.runtime.test_tool_result_text:Reader",
            "tools": ["tests.runtime.test_tool_result_text:echo"],
        }
    }
    async with memory_env(agents) as env:
        snap = await env.load(await env.submit("r", text))
        assert snap.state is SessionState.COMPLETED, (snap.state, snap.error)
        assert snap.result == text
