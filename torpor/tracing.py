"""OpenTelemetry spans around torpor's work, continuing the sender's ``traceparent``.

Only ``opentelemetry-api`` is imported here: without an SDK installed and configured the
spans are no-ops. A webhook's ``traceparent`` header becomes the parent of the webhook
span; verify, the inbox write and the activation it triggers are its children; agent
steps, tool calls and LLM calls are children of the activation. Across a process
boundary (a Ray actor call) the context travels as a ``traceparent`` string
(:func:`traceparent`, :func:`continued`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "torpor"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context's two


def _tracer() -> trace.Tracer:
    # Looked up per use: the SDK may be configured after this module is imported.
    return trace.get_tracer(TRACER_NAME)


def _context_of(headers: Mapping[str, str]) -> otel_context.Context:
    return _PROPAGATOR.extract(carried(headers))


def carried(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers among ``headers``, whatever their case, by lower-case name:
    all :func:`continued` and a log line's trace id read, found in one pass over a
    webhook's headers."""
    return {k.lower(): v for k, v in headers.items() if k.lower() in TRACE_HEADERS}


def continued(carrier: Mapping[str, str] | str | None) -> AbstractContextManager[None]:
    """Make the trace in ``carrier`` (headers, or a bare ``traceparent``) the current
    context inside; without a valid one, the current context stays. Read when called."""
    if not carrier:
        return _STAYS
    headers = {"traceparent": carrier} if isinstance(carrier, str) else carrier
    ctx = _context_of(headers)
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return _STAYS
    return _Attached(ctx)


# Context managers as classes, not generators: a webhook enters three of these, and a
# generator's costs some 70 interpreted instructions more each (``bench/profile_gateway.py
# --instructions``).
class _Attached:
    """``ctx`` current inside the block; the context before it current again after."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: otel_context.Context) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._ctx)

    def __exit__(self, *_: object) -> None:
        otel_context.detach(self._token)


class _CurrentSpan:
    """What the API's no-op span would be, without making and attaching it (about 12 us
    a span, three a webhook): it carries the current context, which stays current, so
    trace_id() and traceparent() inside answer the same."""

    __slots__ = ()

    def __enter__(self) -> trace.Span:
        return trace.get_current_span()

    def __exit__(self, *_: object) -> None:
        return None


_STAYS = nullcontext()
_CURRENT = _CurrentSpan()


def recording() -> bool:
    """Whether an SDK's tracer provider is set (in code or by ``OTEL_PYTHON_TRACER_PROVIDER``):
    without one every span is a no-op. Asked per span: it may be set at any time."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def span(name: str, **attributes: Any) -> AbstractContextManager[trace.Span]:
    """A span, child of the current context, with ``None`` attributes left out; the
    current span when no SDK records (asked when called: one may be set at any time)."""
    if not recording():
        return _CURRENT
    clean = {k: v for k, v in attributes.items() if v is not None}
    return _tracer().start_as_current_span(name, attributes=clean)


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
