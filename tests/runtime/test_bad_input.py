"""Bad input does not flow on: a tool error the plan does not branch on ends the session,
and a wait never goes out under an action key built from missing values."""

from __future__ import annotations

from tests.runtime.memory_env import memory_env, plan_agent, reset
from torpor.demo.tools import PLAN as DEMO_PLAN
from torpor.lifecycle import SessionState

S = SessionState
DEMO_TOOLS = {
    "torpor.demo.tools:ExtractFields": {},
    "tests.runtime.memory_env:RecordingApproval": {},
}


async def test_a_non_document_fails_the_demo_session_before_any_approval_is_asked() -> None:
    async with memory_env({"demo": plan_agent(DEMO_PLAN, DEMO_TOOLS)}) as env:
        probe = reset()
        sid = await env.submit("demo", {"not": "a purchase document"})
        snap = await env.load(sid)
        assert snap.state is S.FAILED
        assert snap.error is not None and snap.error.code == "unhandled_tool_error"
        assert "extract" in snap.error.message and "not a purchase document" in snap.error.message
        # Nothing was asked of the OA system, least of all approve:None.
        assert probe.calls == [] and probe.dispatched == []
        assert snap.waits == [] and snap.outbox == []


async def test_an_error_branch_takes_a_failed_call() -> None:
    plan = {
        "steps": [
            {
                "id": "extract",
                "calls": [{"tool": "extract_fields", "args": {"document": "x"}}],
                "on_error": "failed",
            },
            {"id": "done", "finish": {"decision": "ok"}},
            {
                "id": "failed",
                "finish": {"decision": "error", "why": "${results.extract.error.code}"},
            },
        ]
    }
    async with memory_env({"p": plan_agent(plan, DEMO_TOOLS)}) as env:
        reset()
        snap = await env.load(await env.submit("p"))
        assert snap.state is S.COMPLETED
        assert snap.result == {"decision": "error", "why": "tool_error"}


async def test_a_call_naming_a_missing_value_fails_the_session_before_it_goes_out() -> None:
    """``${input.nope}`` was rendered as null and the approval asked with ``doc_id: null``;
    only the tool's own check of its action key kept the wait from going out."""
    plan = {
        "steps": [
            {
                "id": "approve",
                "calls": [{"tool": "request_approval", "args": {"doc_id": "${input.nope}"}}],
            },
            {"id": "done", "finish": {"decision": "ok"}},
        ]
    }
    async with memory_env({"p": plan_agent(plan, DEMO_TOOLS)}) as env:
        probe = reset()
        snap = await env.load(await env.submit("p", {"doc": "PR-1"}))
        assert snap.state is S.FAILED
        assert snap.error is not None and snap.error.code == "plan_path_missing"
        assert "${input.nope}" in snap.error.message
        assert probe.calls == [] and probe.dispatched == [] and snap.waits == []


async def test_a_wait_keyed_on_a_null_value_fails_the_call_not_the_process() -> None:
    plan = {
        "steps": [
            {
                "id": "approve",
                "calls": [{"tool": "request_approval", "args": {"doc_id": "${input.doc_id}"}}],
                "branches": [
                    {"when": {"path": "results.approve.error", "op": "exists"}, "goto": "failed"}
                ],
            },
            {"id": "done", "finish": {"decision": "ok"}},
            {"id": "failed", "finish": "${results.approve.error.code}"},
        ]
    }
    async with memory_env({"p": plan_agent(plan, DEMO_TOOLS)}) as env:
        probe = reset()
        snap = await env.load(await env.submit("p", {"doc": "PR-1", "doc_id": None}))
        assert len(probe.calls) == 1, "begin was called, with doc_id null"
        assert snap.state is S.COMPLETED and snap.result == "action_key_incomplete"
        assert probe.dispatched == [] and snap.waits == []
