"""A sync tool's result that no snapshot can hold is a tool error the agent sees."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import JsonValue

from tests.runtime.memory_env import memory_env, plan_agent
from torpor.lifecycle import SessionState
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
