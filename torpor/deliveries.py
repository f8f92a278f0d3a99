"""Delivery records: one per outbound notification, tracking every attempt to send it.

A *notification* is the message (``torpor.notify`` builds and signs it); a *delivery* is
the durable record of getting it to the submitter's endpoint: its status, attempts and
history. The delivery id is derived from the outbox entry, so it is also the
``webhook-id`` the receiver sees on every attempt: receivers dedupe retries on it.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from torpor.ids import digest


class DeliveryStatus(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    DEAD = "dead"  # every attempt failed: the dead letter, until someone resends it
    DISABLED = "disabled"  # the endpoint answered 410 Gone


def delivery_id_for(idempotency_key: str) -> str:
    """The delivery of one NOTIFY outbox entry, named by the entry's key: an outbox replay
    finds the same delivery, and retention finds it from the snapshot."""
    return "d_" + digest(idempotency_key, length=24)


class Delivery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delivery_id: str
    tenant: str
    session_id: str
    url: str
    event_type: str
    payload: dict[str, Any]
    status: DeliveryStatus = DeliveryStatus.PENDING
    attempts: int = 0
    next_attempt_at: datetime | None = None
    last_status: int | None = None
    last_error: str | None = None  # the detail, for operators only
    last_category: str | None = None  # what the tenant sees (a ``Failure`` value)
    created_at: datetime
    delivered_at: datetime | None = None
    history: list[dict[str, Any]] = Field(default_factory=list)


class EndpointState(BaseModel):
    """What torpor remembers about a receiving endpoint (410 Gone disables it)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    disabled: bool = False
    disabled_at: datetime | None = None
    reason: str | None = None
