"""OpenTelemetry spans around torpor's work, continuing the sender's ``traceparent``.

Only ``opentelemetry-api`` is imported here: without an SDK installed and configured the
spans are no-ops. A webhook's ``traceparent`` header becomes the parent of the webhook
span; verify, the inbox write and the activation it triggers are its children; agent
steps, tool calls and LLM calls are children of the activation. Across a process
boundary (a Ray actor call) the context travels as a ``traceparent`` string
(:func:`traceparent`, :func:`continued`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "torpor"


def _tracer() -> trace.Tracer:
    # Looked up per use: the SDK may be configured after this module is imported.
    return trace.get_tracer(TRACER_NAME)


def _context_of(headers: Mapping[str, str]) -> otel_context.Context:
    lowered = {
        k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")
    }
    return _PROPAGATOR.extract(lowered)


@contextmanager
def continued(carrier: Mapping[str, str] | str | None) -> Iterator[None]:
    """Make the trace in ``carrier`` (headers, or a bare ``traceparent``) the current
    context inside; without a valid one, the current context stays."""
    if not carrier:
        yield
        return
    headers = {"traceparent": carrier} if isinstance(carrier, str) else carrier
    ctx = _context_of(headers)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def recording() -> bool:
    """Whether an SDK's tracer provider is set (in code or by ``OTEL_PYTHON_TRACER_PROVIDER``):
    without one every span is a no-op. Asked per span: it may be set at any time."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span, child of the current context, with ``None`` attributes left out."""
    if not recording():
        # What the API's no-op span would be, without making and attaching it (about
        # 12 us a span, three a webhook): it carries the current context, which stays
        # current, so trace_id() and traceparent() inside answer the same.
        yield trace.get_current_span()
        return
    clean = {k: v for k, v in attributes.items() if v is not None}
    with _tracer().start_as_current_span(name, attributes=clean) as current:
        yield current


def traceparent() -> str | None:
    """The current context as a ``traceparent`` value, to carry across a process."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def inject(headers: dict[str, str]) -> None:
    """Add the current context's ``traceparent`` to outgoing ``headers``."""
    _PROPAGATOR.inject(headers)


def trace_id() -> str | None:
    """The current trace id (32 hex digits), if a valid span is current."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
