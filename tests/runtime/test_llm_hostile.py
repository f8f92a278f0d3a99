"""Hostile answers from an OpenAI-compatible endpoint, through the real runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.runtime.test_llm_agent import assistant
from tests.support.fake_llm import (
    FakeLLM,
    FakeReply,
    chat_completion,
    text_completion,
    tool_call_completion,
)
from tests.support.harness import local_env
from torpor.lifecycle import SessionState


def lone_surrogate(request: dict[str, Any]) -> FakeReply:
    """A final answer whose content is valid JSON but no Unicode text: half an emoji."""
    body = chat_completion(request, {"role": "assistant", "content": "HERE"}, "stop")
    return FakeReply(200, json.dumps(body).replace("HERE", "half an emoji \\ud83d"))


async def test_a_lone_surrogate_in_the_answer_fails_the_session_with_an_agent_error(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The turn was taken, its snapshot could not be encoded, the commit raised, and every
    replay met it again: the session stayed RUNNING for good."""
    with FakeLLM(lone_surrogate) as llm:
        agents = assistant(llm, "ExtractFields", redis_url, redis_prefix)
        async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents}) as env:
            submitted = await env.control.submit(tenant="acme", agent="assistant", input="PR-1")
            snap = await env.load(submitted.session_id)
            assert snap.state is SessionState.FAILED, snap.state
            assert snap.error is not None and snap.error.code == "agent_error"
            assert "surrogate" in snap.error.message


def surrogate_argument(request: dict[str, Any]) -> dict[str, Any]:
    """Calls a sync tool that echoes its argument, with an escaped lone surrogate in the
    arguments' JSON; then answers with what the tool said."""
    last = request["messages"][-1]
    if last["role"] == "user":
        return tool_call_completion(request, "extract_fields", '{"doc": "PR-1 \\ud83d"}')
    return text_completion(request, f"the tool said: {last.get('content')}")


async def test_a_lone_surrogate_in_the_arguments_is_a_tool_error_the_model_sees(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The tool ran on it and echoed it; its result could not be encoded in the snapshot,
    the commit raised, and every replay ran the tool again: RUNNING for good."""
    with FakeLLM(surrogate_argument) as llm:
        agents = assistant(llm, "ExtractFields", redis_url, redis_prefix)
        async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents}) as env:
            submitted = await env.control.submit(tenant="acme", agent="assistant", input="PR-1")
            snap = await env.load(submitted.session_id)
            assert snap.state is SessionState.COMPLETED, snap.state
            [tool] = [m for m in snap.messages if m.role == "tool"]
            assert "bad_arguments" in (tool.content or "") and "surrogate" in tool.content
