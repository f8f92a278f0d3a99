"""OpenTelemetry spans continue the sender's traceparent through verify, the inbox, the
activation, agent steps, tool calls and LLM calls; read with the SDK's in-memory
exporter."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support.fake_llm import FakeLLM
from tests.support.harness import local_env
from torpor import tracing
from torpor.lifecycle import SessionState
from torpor.service.gateway import WebhookGateway
from torpor.webhooks.signing import Scheme, generate_secret, sign

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
SECRET = generate_secret(Scheme.TORPOR)
SOURCES = {
    "oa": {
        "tenant": "acme",
        "scheme": "torpor",
        "secrets": [SECRET],
        "mapping": {
            "event_id_path": "eventId",
            "type_path": "eventType",
            "correlation_id_path": "correlationId",
            "status_path": "decision.status",
            "data_path": "decision",
        },
    }
}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first SDK provider in this process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return memory


@pytest.fixture
def spans(exporter: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    exporter.clear()
    yield exporter
    exporter.clear()


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def by_name(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def parent_of(span: ReadableSpan) -> str | None:
    return hex_id(span.parent.span_id, 16) if span.parent else None


def span_id(span: ReadableSpan) -> str:
    return hex_id(span.context.span_id, 16)


async def test_a_webhooks_traceparent_continues_into_the_activation_it_wakes(
    tmp_path: Path, redis_url: str, redis_prefix: str, spans: InMemorySpanExporter
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"sources": SOURCES}) as env:
        sid = await env.submit()
        wait = (await env.load(sid)).waits[0]
        spans.clear()
        raw = json.dumps(
            {
                "eventId": "e1",
                "eventType": "oa.approval.decided",
                "correlationId": wait.correlation_id,
                "decision": {"status": "approved"},
            }
        ).encode()
        headers = {
            **sign(Scheme.TORPOR, raw, SECRET, now=env.clock.now()),
            "Content-Type": "application/json",
            "traceparent": TRACEPARENT,
        }
        result = await WebhookGateway(env.control).receive("oa", raw, headers, now=env.clock.now())
        assert result.status == 202
        await env.control.drain()
        assert (await env.load(sid)).state is SessionState.COMPLETED
        await env.services.audit.close()
        records = [
            json.loads(line)
            for key in (await env.services.store.list("audit/")).keys
            for line in (await env.services.store.get(key)).data.decode().splitlines()
        ]
    finished = spans.get_finished_spans()
    assert {hex_id(s.context.trace_id, 32) for s in finished} == {TRACE}, "one trace"
    [hook] = by_name(finished, "torpor.webhook")
    [verify] = by_name(finished, "torpor.verify")
    [inbox] = by_name(finished, "torpor.inbox.write")
    [activation] = by_name(finished, "torpor.activation")
    steps = by_name(finished, "torpor.agent.step")
    assert parent_of(hook) == PARENT, "the sender's span is the parent"
    assert parent_of(verify) == parent_of(inbox) == span_id(hook)
    assert parent_of(activation) == span_id(hook)
    assert activation.attributes and activation.attributes["torpor.session_id"] == sid
    assert steps and all(parent_of(s) == span_id(activation) for s in steps)
    [accepted] = [r for r in records if r.get("verdict") == "accepted"]
    assert accepted["trace_id"] == TRACE, "the audit record names the trace"


async def test_a_submit_under_a_trace_records_it_and_traces_tool_calls(
    tmp_path: Path, redis_url: str, redis_prefix: str, spans: InMemorySpanExporter
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        with tracing.continued(TRACEPARENT):
            sid = await env.submit()
            await env.control.drain()
        snap = await env.load(sid)
    assert snap.trace_id == TRACE, "the session records the caller's trace id"
    finished = spans.get_finished_spans()
    [activation] = by_name(finished, "torpor.activation")
    assert parent_of(activation) == PARENT
    steps = by_name(finished, "torpor.agent.step")
    [call] = by_name(finished, "torpor.tool.call")
    [begin] = by_name(finished, "torpor.tool.begin")
    [dispatch] = by_name(finished, "torpor.tool.dispatch")
    assert steps and all(parent_of(step) == span_id(activation) for step in steps)
    assert parent_of(call) == parent_of(begin) == parent_of(dispatch) == span_id(activation)
    assert call.attributes and call.attributes["torpor.tool"] == "extract_fields"
    assert dispatch.attributes and dispatch.attributes["torpor.tool"] == "request_approval"


async def test_llm_calls_are_spans_under_the_agent_step_and_carry_the_trace(
    tmp_path: Path, redis_url: str, redis_prefix: str, spans: InMemorySpanExporter
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
            with tracing.continued(TRACEPARENT):
                await env.control.submit(tenant="acme", agent="assistant", input="PR-LLM")
                await env.control.drain()
    finished = spans.get_finished_spans()
    steps = {span_id(s) for s in by_name(finished, "torpor.agent.step")}
    calls = by_name(finished, "torpor.llm.call")
    assert calls and len(calls) == len(steps), "one chat completion per agent step"
    for llm_call in calls:
        assert parent_of(llm_call) in steps
        assert llm_call.attributes and llm_call.attributes["gen_ai.request.model"] == "qwen-test"
        # The host alone: the endpoint's URL may carry a key (user part, query), and the
        # spans go to a collector as they are.
        assert llm_call.attributes["server.address"] == "127.0.0.1"
        assert hex_id(llm_call.context.trace_id, 32) == TRACE


def test_a_traceparent_crosses_a_process_boundary_as_a_string(
    spans: InMemorySpanExporter,
) -> None:
    # what RayActivator sends and the session actor continues
    with tracing.continued(TRACEPARENT), tracing.span("caller"):
        carried = tracing.traceparent()
    assert carried is not None and carried.split("-")[1] == TRACE
    with tracing.continued(carried), tracing.span("callee"):
        pass
    [caller] = by_name(spans.get_finished_spans(), "caller")
    [callee] = by_name(spans.get_finished_spans(), "callee")
    assert parent_of(callee) == span_id(caller)
    with tracing.continued("garbage"):
        assert tracing.trace_id() is None


def test_an_otlp_endpoint_without_the_exporter_installed_is_a_clear_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from actors.telemetry import configure_tracing
    from torpor.errors import ConfigError
    from torpor.settings import Settings

    configure_tracing(Settings.build({}))  # unset: nothing to do, nothing imported
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    settings = Settings.build({"runtime": {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces"}})
    with pytest.raises(ConfigError, match=r"torpor\[otlp\]"):
        configure_tracing(settings)


NO_SDK_YET = f"""
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torpor import tracing

assert not tracing.recording()
with tracing.continued("{TRACEPARENT}"), tracing.span("unrecorded", a=1) as current:
    # What the API's no-op span would carry: the sender's trace, to the next process too.
    assert tracing.trace_id() == "{TRACE}"
    assert tracing.traceparent() == "{TRACEPARENT}"
    assert current.get_span_context().span_id == int("{PARENT}", 16)
assert tracing.trace_id() is None  # nothing left attached
memory = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(memory))
trace.set_tracer_provider(provider)  # configured later: spans are recorded from now on
assert tracing.recording()
with tracing.continued("{TRACEPARENT}"), tracing.span("recorded"):
    assert tracing.traceparent().split("-")[2] != "{PARENT}"  # a span of its own
assert [s.name for s in memory.get_finished_spans()] == ["recorded"]
print("ok")
"""


def test_without_an_sdk_spans_cost_nothing_and_still_carry_the_trace() -> None:
    # A fresh interpreter: a tracer provider can be set only once per process, and this
    # module's exporter has set one here.
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", NO_SDK_YET], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
