"""Outbound notifications, the pure part: payloads, signing secrets, retry schedule.

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
from typing import Any

from torpor.backoff import Backoff
from torpor.models import SessionSnapshot

# Svix's schedule (seconds after the previous attempt), used with ±20 % jitter.
RETRY_SCHEDULE_S: list[float] = [5, 300, 1800, 7200, 18000, 36000, 36000]
RETRY_BACKOFF = Backoff(schedule=RETRY_SCHEDULE_S, jitter=0.2)
MAX_RETRY_AFTER_S = 24 * 3600.0  # a receiver asking for more is not waited for longer


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
