"""The OpenTelemetry SDK for a torpor process: spans exported over OTLP/HTTP when
``runtime.otlp_endpoint`` is set (``pip install torpor[otlp]``); otherwise the spans of
``torpor.tracing`` stay no-ops and cost nothing."""

from __future__ import annotations

from typing import Any

from torpor.errors import ConfigError
from torpor.settings import Settings

_CONFIGURED: set[str] = set()


def configure_tracing(settings: Settings) -> None:
    """Install a batching OTLP exporter once per process (idempotent per endpoint)."""
    endpoint = settings.runtime.otlp_endpoint
    if not endpoint or endpoint in _CONFIGURED:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(
            f"runtime.otlp_endpoint is set but the OTLP exporter is not installed "
            f"(pip install 'torpor[otlp]'): {exc.name}"
        ) from None
    provider: Any = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # an application's own SDK setup wins
        provider = TracerProvider(resource=Resource.create({"service.name": "torpor"}))
        trace.set_tracer_provider(provider)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _CONFIGURED.add(endpoint)
