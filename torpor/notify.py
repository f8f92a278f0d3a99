"""Outbound notifications, the pure part: payloads, signing secrets, retry timing.

Notifications follow Standard Webhooks: ``webhook-id`` (stable across retries),
``webhook-timestamp`` and ``webhook-signature`` signed with a per-endpoint secret. The
secret is derived from the deployment's notify key, the tenant and the endpoint URL, so
nothing per endpoint needs storing and a tenant can fetch its endpoint's secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from torpor.models import SessionSnapshot

# Svix's schedule (seconds after the previous attempt), used with ±20 % jitter.
RETRY_SCHEDULE_S: list[float] = [5, 300, 1800, 7200, 18000, 36000, 36000]
MAX_RETRY_AFTER_S = 24 * 3600.0


def endpoint_secret(notify_key: bytes, tenant: str, url: str) -> str:
    raw = hmac.new(notify_key, f"{tenant}\x00{url}".encode(), hashlib.sha256).digest()
    return "whsec_" + base64.b64encode(raw).decode()


def event_type(state: str) -> str:
    return f"session.{state.lower()}"


def payload(snapshot: SessionSnapshot, *, event: str, now: datetime) -> dict[str, Any]:
    return {
        "type": event_type(event),
        "timestamp": now.astimezone(UTC).isoformat(),
        "data": {
            "session_id": snapshot.session_id,
            "tenant": snapshot.tenant,
            "state": snapshot.state.value,
            "epoch": snapshot.epoch,
            "result": snapshot.result,
            "error": snapshot.error.model_dump(mode="json") if snapshot.error else None,
            "batch_id": snapshot.batch_id,
            "metadata": snapshot.metadata,
        },
    }


def retry_after_s(value: str | None, *, now: datetime) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, min((when - now).total_seconds(), MAX_RETRY_AFTER_S))
