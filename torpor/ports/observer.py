"""The observer port: metrics, event streams and alerts hang off these hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torpor.deliveries import Delivery
    from torpor.events import InboxEvent
    from torpor.lifecycle import SessionState
    from torpor.models import OutboxEntry, SessionSnapshot, Wait


class Observer:
    """Hooks for metrics, event streams and alerts. The default does nothing."""

    async def transitioned(self, snapshot: SessionSnapshot, previous: SessionState) -> None:
        return None

    async def observed(self, snapshot: SessionSnapshot, event: InboxEvent, why: str) -> None:
        return None

    async def applied(self, snapshot: SessionSnapshot, event: InboxEvent) -> None:
        return None

    async def security_alert(
        self, snapshot: SessionSnapshot, wait: Wait, reasons: list[str]
    ) -> None:
        return None

    async def agent_step(self, snapshot: SessionSnapshot) -> None:
        return None

    async def webhook_handled(self, source: str, outcome: str, reason: str = "") -> None:
        """An inbound webhook was accepted, a duplicate, unknown or rejected (``reason``)."""
        return

    async def delivery_settled(self, delivery: Delivery) -> None:
        """One attempt at an outbound notification ended with ``delivery.status``."""
        return

    async def outbox_dispatched(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        """An outbox entry was sent and its DISPATCHED status committed: ``created_at`` to
        ``dispatched_at`` is the outbox lag."""
        return

    async def dead_letter(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        """An outbox entry gave up for good (a compensation or notice nobody received):
        alert an operator, who can resend it (``SessionService.resend_outbox``)."""
        return

    async def sweep_step_failed(self, step: str) -> None:
        """One step of a reconciler sweep raised (it is logged with its traceback; the
        other steps still ran)."""
        return

    async def sweep_completed(self, *, started_at: float, duration_s: float) -> None:
        """A reconciler sweep ran every step (``started_at``: seconds since the epoch)."""
        return

    async def activation_deferred(self, reason: str) -> None:
        """An activation request was not sent now (backpressure, or it failed): a timer
        brings the reconciler round instead."""
        return
