"""OpenAIAgent against a real local HTTP server speaking the chat-completions protocol."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from pydantic import SecretStr

from tests.support.fake_llm import (
    FakeLLM,
    FakeReply,
    chat_completion,
    scripted_responder,
    text_completion,
    tool_call_completion,
    validate_request,
)
from torpor.agent import Agent, AgentContext
from torpor.agents import openai_agent
from torpor.agents.openai_agent import OpenAIAgent
from torpor.errors import AgentError, AgentUnavailable, ConfigError
from torpor.models import Message, ToolCall, ToolCallFunction
from torpor.tools import ToolSpec

KEY = "sk-test-SECRET-0123456789abcdef"
SUMMARIZE = ToolSpec(
    name="summarize",
    description="Summarize a document",
    parameters={"type": "object", "properties": {"doc": {"type": "string"}}, "required": ["doc"]},
)


class Sleeps:
    """Records requested delays instead of waiting them out."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class Clock:
    """Monotonic seconds that move only when a backoff is slept through."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ClockSleeps(Sleeps):
    """Records each delay and moves ``clock`` past it, at once."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.clock.now += seconds


@pytest.fixture
def llm() -> Iterator[FakeLLM]:
    with FakeLLM() as server:
        yield server


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


def make_agent(server: FakeLLM, sleeps: Sleeps | None = None, **kwargs: Any) -> OpenAIAgent:
    kwargs.setdefault("backoff_s", 0.001)
    return OpenAIAgent(base_url=server.base_url, model="fake-model", sleep=sleeps, **kwargs)


def ctx(tools: list[ToolSpec] | None = None, deadline: float | None = None) -> AgentContext:
    return AgentContext(
        session_id="s-1",
        tenant="t-1",
        step=0,
        input="hello",
        metadata={},
        tools=[SUMMARIZE] if tools is None else tools,
        deadline=deadline,
    )


def user(text: str) -> list[Message]:
    return [Message(role="user", content=text)]


def reply_once(first: FakeReply | dict[str, Any]) -> Any:
    """A responder that answers ``first`` once, then follows the script."""
    pending = [first]

    def responder(request: dict[str, Any]) -> dict[str, Any] | FakeReply:
        return pending.pop() if pending else scripted_responder(request)

    return responder


# --- happy paths -----------------------------------------------------------------------


async def test_tool_call_turn_is_parsed(llm: FakeLLM) -> None:
    turn = await make_agent(llm).step(user("the report"), ctx())

    assert not turn.final and turn.result is None
    assert turn.message.role == "assistant"
    [call] = turn.message.tool_calls or []
    assert call.id.startswith("call_fake")
    assert call.function.name == "summarize"
    assert json.loads(call.function.arguments) == {"doc": "the report"}


async def test_final_turn_carries_the_content_as_result(llm: FakeLLM) -> None:
    llm.responder = lambda request: text_completion(request, "all good")

    turn = await make_agent(llm).step(user("hi"), ctx())

    assert turn.final
    assert turn.message == Message(role="assistant", content="all good")
    assert turn.result == "all good"


async def test_request_body_has_tools_and_the_messages_exactly(llm: FakeLLM) -> None:
    history = [
        Message(role="system", content="be brief"),
        Message(role="user", content="summarize x"),
        Message(
            role="assistant",
            tool_calls=[
                ToolCall(
                    id="call_1",
                    function=ToolCallFunction(name="summarize", arguments='{"doc": "x"}'),
                )
            ],
        ),
        Message(role="tool", tool_call_id="call_1", content="short x"),
    ]

    await make_agent(llm, max_tokens=64, temperature=0.3).step(history, ctx())

    [body] = llm.chat_requests
    assert body["model"] == "fake-model"
    assert body["messages"] == [m.to_openai() for m in history]
    assert body["messages"][2] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "summarize", "arguments": '{"doc": "x"}'},
            }
        ],
    }
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "summarize",
                "description": "Summarize a document",
                "parameters": SUMMARIZE.parameters,
            },
        }
    ]
    assert body["tool_choice"] == "auto"
    assert body["temperature"] == 0.3
    assert body["max_tokens"] == 64
    assert llm.requests[0].headers["content-type"] == "application/json"


async def test_without_tools_the_request_omits_tools_and_tool_choice(llm: FakeLLM) -> None:
    turn = await make_agent(llm).step(user("hi"), ctx(tools=[]))

    [body] = llm.chat_requests
    assert "tools" not in body and "tool_choice" not in body and "max_tokens" not in body
    assert turn.result == "echo: hi"


async def test_bearer_key_is_sent() -> None:
    with FakeLLM(api_key=KEY) as server:
        turn = await make_agent(server, api_key=SecretStr(KEY)).step(user("doc"), ctx())

    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"
    assert not turn.final


async def test_no_key_no_authorization_header(llm: FakeLLM) -> None:
    await make_agent(llm).step(user("doc"), ctx())

    assert "authorization" not in llm.requests[0].headers


async def test_full_two_turn_loop_round_trips_the_history(llm: FakeLLM) -> None:
    agent = make_agent(llm, system_prompt="You summarize.")
    context = ctx()
    messages = agent.initial_messages("quarterly report", context)
    assert [m.role for m in messages] == ["system", "user"]

    first = await agent.step(messages, context)
    assert not first.final
    messages.append(first.message)
    for call in first.message.tool_calls or []:
        doc = json.loads(call.function.arguments)["doc"]
        messages.append(Message(role="tool", tool_call_id=call.id, content=f"summary of {doc}"))
    second = await agent.step(messages, context)

    assert second.final
    assert second.result == "done: summary of quarterly report"
    # The server saw (and validated) the tool call it issued, answered by its id.
    assert llm.chat_requests[1]["messages"] == [m.to_openai() for m in messages]
    assert isinstance(agent, Agent)


async def test_empty_tool_calls_list_is_a_final_answer(llm: FakeLLM) -> None:
    message = {"role": "assistant", "content": "plain", "tool_calls": []}  # as vLLM sends it
    llm.responder = lambda request: chat_completion(request, message, "stop")

    turn = await make_agent(llm).step(user("hi"), ctx())

    assert turn.final and turn.message.tool_calls is None and turn.result == "plain"


async def test_arguments_that_are_not_json_pass_through(llm: FakeLLM) -> None:
    llm.responder = lambda request: tool_call_completion(request, "summarize", "{not json", "c1")

    turn = await make_agent(llm).step(user("hi"), ctx())

    assert (turn.message.tool_calls or [])[0].function.arguments == "{not json"


# --- retries -----------------------------------------------------------------------------


async def test_429_with_retry_after_is_retried_after_that_delay(
    llm: FakeLLM, sleeps: Sleeps
) -> None:
    throttled = FakeReply(429, {"error": {"message": "slow down"}}, headers={"Retry-After": "2"})
    llm.responder = reply_once(throttled)

    turn = await make_agent(llm, sleeps).step(user("doc"), ctx())

    assert not turn.final
    assert len(llm.requests) == 2
    assert sleeps.delays == [2.0]


async def test_retry_after_as_an_http_date_is_honoured(llm: FakeLLM, sleeps: Sleeps) -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=3), usegmt=True)
    llm.responder = reply_once(FakeReply(503, "busy", headers={"Retry-After": when}))

    turn = await make_agent(llm, sleeps).step(user("doc"), ctx())

    assert not turn.final and len(llm.requests) == 2
    [delay] = sleeps.delays
    assert 1.0 < delay <= 3.0  # the date has one-second resolution


async def test_500_forever_gives_agent_unavailable_after_all_attempts(
    llm: FakeLLM, sleeps: Sleeps
) -> None:
    llm.responder = lambda request: FakeReply(500, {"error": {"message": "boom"}})

    with pytest.raises(AgentUnavailable, match="HTTP 500") as info:
        await make_agent(llm, sleeps, max_retries=3, backoff_s=0.01).step(user("doc"), ctx())

    assert len(llm.requests) == 4
    assert info.value.retryable and info.value.context["attempts"] == 4
    # Full jitter: each delay is somewhere in [0, backoff * 2**attempt].
    assert len(sleeps.delays) == 3
    assert all(0 <= d <= 0.01 * 2**i for i, d in enumerate(sleeps.delays))


async def test_real_sleep_path_is_fast_with_tiny_backoff(llm: FakeLLM) -> None:
    llm.responder = reply_once(FakeReply(503, "overloaded"))

    turn = await make_agent(llm, max_retries=1).step(user("doc"), ctx())

    assert not turn.final and len(llm.requests) == 2


async def test_400_is_agent_error_without_retry(llm: FakeLLM, sleeps: Sleeps) -> None:
    llm.responder = lambda request: FakeReply(400, {"error": {"message": "context too long"}})

    with pytest.raises(AgentError, match="context too long") as info:
        await make_agent(llm, sleeps).step(user("doc"), ctx())

    assert not info.value.retryable and info.value.context["status"] == 400
    assert len(llm.requests) == 1 and sleeps.delays == []


async def test_invalid_history_is_rejected_by_the_server(llm: FakeLLM) -> None:
    orphan = [user("x")[0], Message(role="tool", tool_call_id="nope", content="?")]

    with pytest.raises(AgentError, match="role 'tool' must be a response"):
        await make_agent(llm).step(orphan, ctx())


async def test_redirect_is_not_followed(llm: FakeLLM) -> None:
    # urllib would follow a 302 as a GET carrying the Authorization header along.
    elsewhere = f"http://127.0.0.1:{llm.port}/elsewhere"
    llm.responder = lambda request: FakeReply(302, "", headers={"Location": elsewhere})

    with pytest.raises(AgentError, match="HTTP 302"):
        await make_agent(llm, api_key=KEY).step(user("doc"), ctx())

    assert [r.path for r in llm.requests] == ["/v1/chat/completions"]


async def test_connection_refused_is_agent_unavailable(sleeps: Sleeps) -> None:
    with FakeLLM() as server:
        agent = make_agent(server, sleeps, max_retries=2)
    # The server is stopped: its port now refuses connections.

    with pytest.raises(AgentUnavailable, match="3 attempts"):
        await agent.step(user("doc"), ctx())

    assert len(sleeps.delays) == 2


async def test_timeout_is_agent_unavailable(llm: FakeLLM, sleeps: Sleeps) -> None:
    llm.responder = lambda request: FakeReply(200, text_completion(request, "late"), delay_s=10)

    with pytest.raises(AgentUnavailable, match="TimeoutError"):
        await make_agent(llm, sleeps, timeout_s=0.1, max_retries=1).step(user("doc"), ctx())

    assert len(llm.requests) == 2


def throttled_for(seconds: int) -> Any:
    """Every answer a 503 asking for ``seconds`` of pause: exact delays, no jitter."""
    return lambda request: FakeReply(503, "busy", headers={"Retry-After": str(seconds)})


async def test_retries_stop_when_the_next_attempt_would_start_past_the_step_deadline(
    llm: FakeLLM,
) -> None:
    """Four attempts of 60 s and three pauses of up to 60 s ran about 420 s against the
    runtime's 300 s step deadline: the step timed out while the client still waited."""
    clock = Clock()
    sleeps = ClockSleeps(clock)
    llm.responder = throttled_for(60)
    agent = make_agent(llm, sleeps, timeout_s=60, max_retries=3, monotonic=clock)

    with pytest.raises(AgentUnavailable, match="2 attempts before the step's deadline") as info:
        await agent.step(user("doc"), ctx(deadline=clock.now + 100))

    # Attempt 0 at 0 s, its pause to 60 s, attempt 1; its pause would end at 120 s.
    assert len(llm.requests) == 2 and sleeps.delays == [60.0]
    assert info.value.retryable and info.value.context["attempts"] == 2
    assert clock.now == 1060.0


async def test_each_attempt_has_only_what_is_left_of_the_step(
    llm: FakeLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeouts: list[float] = []
    real = openai_agent.request_async

    async def spy(*args: Any, timeout_s: float, **kwargs: Any) -> Any:
        timeouts.append(timeout_s)
        return await real(*args, timeout_s=timeout_s, **kwargs)

    monkeypatch.setattr("torpor.agents.openai_agent.request_async", spy)
    clock = Clock()
    llm.responder = throttled_for(30)
    agent = make_agent(llm, ClockSleeps(clock), timeout_s=60, max_retries=3, monotonic=clock)

    with pytest.raises(AgentUnavailable):
        await agent.step(user("doc"), ctx(deadline=clock.now + 45))

    assert timeouts == [45.0, 15.0]


async def test_a_step_past_its_deadline_sends_nothing(llm: FakeLLM, sleeps: Sleeps) -> None:
    clock = Clock()
    agent = make_agent(llm, sleeps, monotonic=clock)

    with pytest.raises(AgentUnavailable, match="no time left") as info:
        await agent.step(user("doc"), ctx(deadline=clock.now))

    assert info.value.retryable and llm.requests == [] and sleeps.delays == []


# --- malformed answers -------------------------------------------------------------------


def _call(**overrides: Any) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": "c1",
        "type": "function",
        "function": {"name": "summarize", "arguments": "{}"},
    }
    call.update(overrides)
    return call


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("{not json", "not JSON"),
        ({"object": "chat.completion"}, "no choices"),
        ({"choices": []}, "no choices"),
        ({"choices": [{"index": 0}]}, "message missing"),
        ({"choices": [{"message": {"role": "assistant", "content": 7}}]}, "content"),
        ({"choices": [{"message": {"tool_calls": [_call(id=None)]}}]}, "without id"),
        (
            {"choices": [{"message": {"tool_calls": [_call(function={"arguments": "{}"})]}}]},
            "without function name",
        ),
        (
            {
                "choices": [
                    {
                        "message": {
                            "tool_calls": [_call(function={"name": "s", "arguments": {"a": 1}})]
                        }
                    }
                ]
            },
            "not a string",
        ),
        ({"choices": [{"message": {"tool_calls": [_call(), _call()]}}]}, "duplicate tool call ids"),
        ({"choices": [{"message": {"content": "cut"}, "finish_reason": "length"}]}, "length"),
        # Filtered or refused: no result, where the session completed with None.
        (
            {"choices": [{"message": {"content": None}, "finish_reason": "content_filter"}]},
            "content_filter",
        ),
        (
            {"choices": [{"message": {"content": None, "refusal": "I can't help with that."}}]},
            "refused",
        ),
        # Neither an answer nor a call: the session completed with the result None.
        (
            {"choices": [{"message": {"role": "assistant"}, "finish_reason": "stop"}]},
            "no content and no tool calls",
        ),
        (
            {"choices": [{"message": {"content": None, "tool_calls": []}}]},
            "no content and no tool calls",
        ),
    ],
)
async def test_malformed_answers_are_agent_errors(llm: FakeLLM, body: Any, why: str) -> None:
    llm.responder = lambda request: FakeReply(200, body)

    with pytest.raises(AgentError, match=why) as info:
        await make_agent(llm).step(user("doc"), ctx())

    assert not info.value.retryable and len(llm.requests) == 1


# --- secrets and configuration -------------------------------------------------------------


async def test_key_never_appears_in_exception_text() -> None:
    with FakeLLM(api_key="sk-the-right-one") as server:
        # The fake echoes the presented (wrong) key in its 401 body, as gateways do.
        with pytest.raises(AgentError) as rejected:
            await make_agent(server, api_key=KEY).step(user("doc"), ctx())
        assert "Incorrect API key" in str(rejected.value)

        server.api_key = None
        server.responder = lambda request: FakeReply(502, f"upstream said {KEY}")
        with pytest.raises(AgentUnavailable) as unavailable:
            await make_agent(server, Sleeps(), api_key=KEY, max_retries=1).step(user("d"), ctx())

    agent = make_agent(server, api_key=KEY)
    for text in (
        str(rejected.value),
        str(unavailable.value),
        repr(agent),
        str(agent),
        repr(vars(agent)),
    ):
        assert KEY not in text
        assert KEY[:16] not in text  # not even a truncated prefix
    assert KEY not in repr(rejected.value.context) + repr(unavailable.value.context)
    assert pickle.loads(pickle.dumps(agent))._api_key.get_secret_value() == KEY


@pytest.mark.parametrize("header", ["api-key", "x-api-key", "Helicone-Auth", "X-Gateway-Token"])
async def test_a_key_sent_in_an_extra_header_never_appears_in_exception_text(
    llm: FakeLLM, header: str
) -> None:
    """Azure OpenAI and most gateways take their key in a header of their own, passed as
    an extra header: a gateway that echoed it in an error body put it in the failed
    session's detail, only the Bearer key being redacted."""
    llm.responder = lambda request: FakeReply(401, f"bad credentials: {header}: {KEY}")
    with pytest.raises(AgentError) as rejected:
        await make_agent(llm, extra_headers={header: KEY}).step(user("doc"), ctx())
    llm.responder = lambda request: FakeReply(502, f"upstream said {KEY}")
    with pytest.raises(AgentUnavailable) as unavailable:
        agent = make_agent(llm, Sleeps(), extra_headers={header: KEY}, max_retries=1)
        await agent.step(user("doc"), ctx())
    llm.responder = lambda request: FakeReply(200, f"{{not json {KEY}")
    with pytest.raises(AgentError) as malformed:
        await make_agent(llm, extra_headers={header: KEY}).step(user("doc"), ctx())

    assert llm.requests[0].headers[header.lower()] == KEY
    assert "bad credentials" in str(rejected.value)
    for error in (rejected.value, unavailable.value, malformed.value):
        assert KEY[:16] not in str(error)


async def test_a_key_ending_in_a_line_break_is_sent_without_it(llm: FakeLLM) -> None:
    """A key read from a file often ends so: http.client refused each step with a
    ValueError quoting the header, key included (the failed session's detail)."""
    await make_agent(llm, api_key=KEY + "\n").step(user("doc"), ctx())

    assert llm.requests[0].headers["authorization"] == f"Bearer {KEY}"


@pytest.mark.parametrize(
    ("key", "headers"),
    [
        (KEY[:10] + "\n" + KEY[10:], None),
        (KEY + "\u2019", None),
        (KEY, {"api-key": KEY + "\r\nX-Injected: 1"}),
        (KEY, {"X-Bad\n": "v"}),
    ],
)
def test_a_key_or_header_no_http_header_can_carry_is_a_config_error(
    key: str, headers: dict[str, str] | None
) -> None:
    with pytest.raises(ConfigError, match="cannot carry") as info:
        OpenAIAgent(base_url="http://llm/v1", model="m", api_key=key, extra_headers=headers)

    assert KEY[:16] not in str(info.value)


def test_from_env_reads_the_three_variables() -> None:
    agent = OpenAIAgent.from_env(
        {
            "TORPOR_LLM_BASE_URL": "http://llm.internal:8000/v1/",
            "TORPOR_LLM_MODEL": "qwen",
            "TORPOR_LLM_API_KEY": KEY,
        }
    )

    assert agent.base_url == "http://llm.internal:8000/v1"
    assert agent.model == "qwen"
    assert KEY not in repr(agent)


@pytest.mark.parametrize("missing", ["TORPOR_LLM_BASE_URL", "TORPOR_LLM_MODEL"])
def test_from_env_names_the_missing_variable(missing: str) -> None:
    env = {"TORPOR_LLM_BASE_URL": "http://x/v1", "TORPOR_LLM_MODEL": "m", missing: ""}

    with pytest.raises(ConfigError, match=missing):
        OpenAIAgent.from_env(env)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "localhost:8000", ""])
def test_base_url_must_be_http(url: str) -> None:
    with pytest.raises(ConfigError, match="base_url"):
        OpenAIAgent(base_url=url, model="m")


# --- the fake itself is as strict as the real API ---------------------------------------------

_OK_MESSAGES = [{"role": "user", "content": "hi"}]
_ASKED = {"role": "assistant", "content": None, "tool_calls": [_call()]}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"messages": _OK_MESSAGES}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "invalid role"),
        ({"model": "m", "messages": [*_OK_MESSAGES, _ASKED]}, "not answered"),
        ({"model": "m", "messages": [*_OK_MESSAGES, _ASKED, *_OK_MESSAGES]}, "not answered"),
        ({"model": "m", "messages": _OK_MESSAGES, "tools": []}, "tools"),
        ({"model": "m", "messages": _OK_MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
        ({"model": "m", "messages": _OK_MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_fake_rejects_what_openai_rejects(body: dict[str, Any], why: str) -> None:
    problem = validate_request(body)

    assert problem is not None and why in problem


@pytest.mark.parametrize(
    "base_url",
    [f"http://127.0.0.1:9/v1?api-key={KEY}", f"http://gateway:{KEY}@127.0.0.1:9/v1"],
    ids=["query", "userinfo"],
)
async def test_a_key_in_the_base_url_never_appears_in_exception_text(base_url: str) -> None:
    """Some gateways take their key in the URL: every error of the endpoint names it."""
    agent = OpenAIAgent(
        base_url=base_url, model="fake-model", sleep=Sleeps(), max_retries=1, backoff_s=0.001
    )
    with pytest.raises((AgentUnavailable, AgentError)) as failed:
        await agent.step(user("doc"), ctx())
    assert "127.0.0.1" in str(failed.value) or "gateway" in str(failed.value)
    assert KEY[:16] not in str(failed.value) and KEY[:16] not in repr(agent)
