"""Events delivered to a session's inbox.

Whoever delivers an event (the webhook ingress, the reconciler's poll, the Python client,
the runtime itself) writes it as one create-only object keyed by source + event id, so a
redelivery is a no-op. The activation reads the inbox; nothing is applied until the gates
say so.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, JsonValue

from torpor.ids import event_key
from torpor.models import Wait


class EventKind(StrEnum):
    CALLBACK = "callback"  # an external system answered a wait (webhook, capability URL)
    POLL = "poll"  # the reconciler asked the external system and it had an answer
    CANCEL = "cancel"  # a client asked to cancel the session
    DISPATCH_FAILED = "dispatch_failed"  # the external request could never be sent
    RETRY = "retry"  # an operator asked to take a quarantined session back
    TOOL_TIMER = "tool_timer"  # a timer a wait's tool set came due (a reminder, an escalation)
    OPERATOR = "operator"  # an operator's instruction for a wait (reassign an approval)


class InboxEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    kind: EventKind
    session_id: str
    source: str
    event_id: str
    type: str
    correlation_id: str | None = None
    business_key: str | None = None
    # Stamped by the deliverer from the binding or capability token it resolved; the
    # epoch/step gate compares them with the wait the session is actually in.
    epoch: int | None = None
    step_id: str | None = None
    data: JsonValue = None
    received_at: datetime
    trace_id: str | None = None
    verified_by: str = "internal"
    # SHA-256 of the signed content that carried the event (webhooks and capability
    # callbacks): kept with the event, so replay memory survives the loss of the index.
    content_digest: str | None = None

    @classmethod
    def new(
        cls,
        *,
        kind: EventKind,
        session_id: str,
        source: str,
        event_id: str,
        type: str,
        received_at: datetime,
        producer: str | None = None,
        **fields: object,
    ) -> InboxEvent:
        """``producer``: a CloudEvent's own ``source`` attribute (``event_key``)."""
        return cls.model_validate(
            {
                "key": event_key(source, event_id, producer=producer),
                "kind": kind,
                "session_id": session_id,
                "source": source,
                "event_id": event_id,
                "type": type,
                "received_at": received_at,
                **fields,
            }
        )

    @classmethod
    def answering(
        cls,
        wait: Wait,
        *,
        kind: EventKind,
        session_id: str,
        source: str,
        event_id: str,
        type: str,
        received_at: datetime,
        data: JsonValue,
        **fields: object,
    ) -> InboxEvent:
        """An event addressed to exactly this wait: its correlation id, epoch and step."""
        return cls.new(
            kind=kind,
            session_id=session_id,
            source=source,
            event_id=event_id,
            type=type,
            received_at=received_at,
            correlation_id=wait.correlation_id,
            epoch=wait.epoch,
            step_id=wait.waiting_step_id,
            data=data,
            producer=None,  # torpor's own events: their source names their producer
            **fields,
        )
