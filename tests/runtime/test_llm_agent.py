"""An OpenAI-compatible agent sleeping on a long-running tool, through the real runtime.

The model is a local HTTP server that speaks the chat-completions protocol; it asks for
the approval tool, the session suspends, the callback comes, and the model's final
answer sees the approval as the tool's result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.fake_llm import FakeLLM, text_completion, tool_call_completion
from tests.support.harness import local_env
from torpor.lifecycle import SessionState


def assistant(llm: FakeLLM, tool: str, redis_url: str, prefix: str) -> dict[str, Any]:
    """Settings' agents: an OpenAI-compatible agent on ``llm`` with one support tool."""
    common = {"redis_url": redis_url, "prefix": prefix}
    return {
        "assistant": {
            "factory": "torpor.agents.openai_agent:OpenAIAgent",
            "options": {"base_url": llm.base_url, "model": "qwen-test", "name": "assistant"},
            "tools": [f"tests.support.tools:{tool}"],
            "tool_options": {f"tests.support.tools:{tool}": common},
        }
    }


async def test_llm_agent_suspends_and_resumes(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    with FakeLLM() as llm:
        agents = assistant(llm, "RequestApproval", redis_url, redis_prefix)
        async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents}) as env:
            submitted = await env.control.submit(tenant="acme", agent="assistant", input="PR-LLM")
            sid = submitted.session_id
            snap = await env.load(sid)
            assert snap.state is SessionState.SUSPENDED
            assert snap.agent.name == "assistant" and snap.waits[0].tool_name == "request_approval"
            assert json.loads(snap.messages[-1].tool_calls[0].function.arguments) == {  # type: ignore[index]
                "doc": "PR-LLM"
            }
            calls_before = len(llm.chat_requests)
            await env.answer(sid, {"status": "approved", "approver": "u-17"})
            done = await env.load(sid)
            assert done.state is SessionState.COMPLETED
            assert isinstance(done.result, str) and "approved" in done.result
            # the model saw exactly one more request: the history with the tool's answer
            assert len(llm.chat_requests) == calls_before + 1
            last = llm.chat_requests[-1]["messages"]
            assert last[-1]["role"] == "tool" and "approved" in last[-1]["content"]


def nested_arguments(request: dict[str, Any]) -> dict[str, Any]:
    """Asks for a sync tool with valid JSON arguments nested past the parser's depth (200
    kB: far under the response cap), then answers with what the tool said."""
    last = request["messages"][-1]
    if last["role"] == "user":
        deep = "[" * 100_000 + "]" * 100_000
        return tool_call_completion(request, "extract_fields", '{"doc": "x", "n": ' + deep + "}")
    return text_completion(request, f"the tool said: {last.get('content')}")


async def test_arguments_nested_too_deeply_are_a_tool_error_the_model_sees(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Their RecursionError escaped the activation, and every replay of the committed turn
    met it again: the session stayed RUNNING for good, retried by every sweep."""
    with FakeLLM(nested_arguments) as llm:
        agents = assistant(llm, "ExtractFields", redis_url, redis_prefix)
        async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents}) as env:
            submitted = await env.control.submit(tenant="acme", agent="assistant", input="PR-1")
            snap = await env.load(submitted.session_id)
            assert snap.state is SessionState.COMPLETED, snap.error
            [tool] = [m for m in snap.messages if m.role == "tool"]
            assert "bad_arguments" in (tool.content or "") and "nested too deeply" in tool.content
