"""An OpenAI-compatible agent sleeping on a long-running tool, through the real runtime.

The model is a local HTTP server that speaks the chat-completions protocol; it asks for
the approval tool, the session suspends, the callback comes, and the model's final
answer sees the approval as the tool's result.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.fake_llm import FakeLLM
from tests.support.harness import local_env
from torpor.lifecycle import SessionState


async def test_llm_agent_suspends_and_resumes(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    with FakeLLM() as llm:
        common = {"redis_url": redis_url, "prefix": redis_prefix}
        agents = {
            "assistant": {
                "factory": "torpor.agents.openai_agent:OpenAIAgent",
                "options": {"base_url": llm.base_url, "model": "qwen-test", "name": "assistant"},
                "tools": ["tests.support.tools:RequestApproval"],
                "tool_options": {"tests.support.tools:RequestApproval": common},
            }
        }
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
