"""PlanAgent: a failed call goes to a branch that takes it, else ``on_error``, else the
session fails with the cause; a ``${path}`` that names nothing fails it too; WaitPlan
refuses an action key with a missing segment."""

from __future__ import annotations

import json
from typing import Any

import pytest

from torpor.agent import AgentContext
from torpor.agents.plan import PlanAgent
from torpor.errors import ActionKeyIncomplete, AgentError, PlanPathMissing, UnhandledToolError
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


async def after_extract(steps: list[dict[str, Any]], result: Any, input: Any = None) -> Any:
    """The turn that follows ``extract``'s answer ``result``."""
    agent = PlanAgent(plan={"steps": steps})
    context = ctx({})
    context.input = input
    first = await agent.step([], context)
    [call] = first.message.tool_calls or []
    answer = Message(role="tool", tool_call_id=call.id, content=json.dumps(result))
    return await agent.step([first.message, answer], context)


def approve_with(args: dict[str, Any]) -> list[dict[str, Any]]:
    return [STEPS[0], {"id": "approve", "calls": [{"tool": "request_approval", "args": args}]}]


async def test_a_call_argument_naming_a_missing_field_is_an_error_naming_the_path() -> None:
    """It was rendered as null and the call went out with ``doc_id: null``."""
    steps = approve_with({"doc_id": "${results.extract.doc_id}"})
    with pytest.raises(PlanPathMissing, match="doc_id") as info:
        await after_extract(steps, {"amount": 10})
    assert info.value.code == "plan_path_missing"
    assert info.value.context["path"] == "results.extract.doc_id"
    assert "plan step 'approve', call 'request_approval'" in str(info.value)
    assert "results.extract has no 'doc_id'" in str(info.value)


async def test_a_missing_path_inside_a_longer_string_is_an_error_not_empty_text() -> None:
    """It was interpolated as "" (``"PR-"`` where ``"PR-17"`` was meant)."""
    steps = approve_with({"doc_id": "PR-${results.extract.number}"})
    with pytest.raises(PlanPathMissing, match=r"\$\{results.extract.number\}"):
        await after_extract(steps, {"amount": 10})


async def test_a_path_through_a_missing_step_result_is_an_error() -> None:
    steps = approve_with({"approver": "${results.review.approver}"})
    with pytest.raises(PlanPathMissing, match="results has no 'review'"):
        await after_extract(steps, {"amount": 10})


async def test_a_finish_naming_a_missing_field_renders_it_as_null() -> None:
    """A finish is the session's result, not an action: what a failed step did not give
    is null there, so the plan's own error path still ends the session with it."""
    finish = {"po": "${results.extract.po_number}", "note": "po ${results.extract.po_number}"}
    steps = [STEPS[0], {"id": "done", "finish": finish}]
    turn = await after_extract(steps, {"amount": 10})
    assert turn.result == {"po": None, "note": "po "}


async def test_a_present_null_is_still_rendered_as_null() -> None:
    """Only a path that names nothing is an error: a value that is there and null is one."""
    steps = approve_with({"doc_id": "${results.extract.doc_id}", "note": "${input.note}"})
    turn = await after_extract(steps, {"doc_id": None}, input={"note": None})
    [call] = turn.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"doc_id": None, "note": None}


async def test_a_path_marked_optional_may_name_nothing() -> None:
    steps = approve_with({"doc_id": "${results.extract.doc_id?}", "ref": "PR-${input.n?}"})
    turn = await after_extract(steps, {"amount": 10}, input={})
    [call] = turn.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"doc_id": None, "ref": "PR-"}


async def test_an_old_snapshots_deeply_nested_str_result_is_read_as_that_str() -> None:
    """A tool's str result was sent as it was before results that read as JSON were
    encoded: an old snapshot holds a message of valid JSON nested past Python's parser.
    Its read raised RecursionError (no ValueError), and the step failed at every replay."""
    deep = "[" * 100_000 + "]" * 100_000
    steps = [
        {"id": "extract", "calls": [{"tool": "extract_fields"}]},
        {"id": "done", "finish": {"got": "${results.extract}"}},
    ]
    agent = PlanAgent(plan={"steps": steps})
    context = ctx({})
    first = await agent.step([], context)
    [call] = first.message.tool_calls or []
    answer = Message(role="tool", tool_call_id=call.id, content=deep)
    turn = await agent.step([first.message, answer], context)
    assert turn.final and turn.result == {"got": deep}
