"""PlanAgent: a failed call goes to a branch that takes it, else ``on_error``, else the
session fails with the cause; WaitPlan refuses an action key with a missing segment."""

from __future__ import annotations

import json
from typing import Any

import pytest

from torpor.agent import AgentContext
from torpor.agents.plan import PlanAgent
from torpor.errors import ActionKeyIncomplete, AgentError, UnhandledToolError
from torpor.models import Message
from torpor.tools import WaitPlan

STEPS: list[dict[str, Any]] = [
    {"id": "extract", "calls": [{"tool": "extract_fields"}]},
    {"id": "approve", "calls": [{"tool": "request_approval"}]},
]


def ctx(variables: dict[str, Any]) -> AgentContext:
    return AgentContext(
        session_id="s", tenant="t", step=0, input=None, metadata={}, tools=[], variables=variables
    )


async def after_failed_extract(steps: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    agent = PlanAgent(plan={"steps": steps})
    context = ctx({})
    first = await agent.step([], context)
    [call] = first.message.tool_calls or []
    answer = Message(
        role="tool",
        tool_call_id=call.id,
        content=json.dumps({"error": {"code": "tool_error", "message": "not a document"}}),
    )
    turn = await agent.step([first.message, answer], context)
    return turn, context.variables


async def test_an_unhandled_tool_error_fails_with_its_cause() -> None:
    with pytest.raises(UnhandledToolError, match="not a document"):
        await after_failed_extract(STEPS)


async def test_on_error_takes_a_failed_call() -> None:
    steps = [{**STEPS[0], "on_error": "failed"}, STEPS[1], {"id": "failed", "finish": "bad"}]
    turn, _ = await after_failed_extract(steps)
    assert turn.final and turn.result == "bad"


async def test_a_branch_on_the_error_takes_it() -> None:
    branch = {"when": {"path": "results.extract.error", "op": "exists"}, "goto": "failed"}
    steps = [{**STEPS[0], "branches": [branch]}, STEPS[1], {"id": "failed", "finish": "x"}]
    turn, _ = await after_failed_extract(steps)
    assert turn.result == "x"


@pytest.mark.parametrize("key", ["approve:None", "approve:null", "approve:", ":x", "a::b", ""])
def test_an_action_key_with_a_missing_segment_is_refused(key: str) -> None:
    with pytest.raises(ActionKeyIncomplete):
        WaitPlan(action_key=key)


def test_a_complete_action_key_is_kept() -> None:
    assert WaitPlan(action_key="approve:PR-1:v2").action_key == "approve:PR-1:v2"


async def test_a_failed_call_is_not_hidden_by_a_later_call_of_its_step() -> None:
    """Two calls of one step without ``as`` both store under the step's id: the second's
    success overwrote the first's error, and the plan flowed on as if both had worked."""
    steps = [
        {"id": "fetch", "calls": [{"tool": "fetch_a"}, {"tool": "fetch_b"}]},
        {"id": "done", "finish": "${results.fetch}"},
    ]
    agent = PlanAgent(plan={"steps": steps})
    context = ctx({})
    first = await agent.step([], context)
    failed, worked = first.message.tool_calls or []
    answers = [
        Message(
            role="tool",
            tool_call_id=failed.id,
            content=json.dumps({"error": {"code": "tool_error", "message": "a is down"}}),
        ),
        Message(role="tool", tool_call_id=worked.id, content=json.dumps({"b": 1})),
    ]
    with pytest.raises(UnhandledToolError, match="a is down"):
        await agent.step([first.message, *answers], context)


async def test_a_session_at_a_step_the_plan_no_longer_has_is_told_so() -> None:
    """Stood at ``approve`` when the plan was edited to drop it: a clear AgentError, where a
    bare KeyError('approve') failed the session as the agent's crash."""
    agent = PlanAgent(plan={"steps": [STEPS[0]]})
    context = ctx({"plan": {"cursor": "approve", "visits": {"approve": 1}, "results": {}}})
    with pytest.raises(AgentError, match="no step 'approve'"):
        await agent.step([], context)
