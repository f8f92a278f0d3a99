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

    async def dead_letter(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        """An outbox entry gave up for good (a compensation or notice nobody received):
        alert an operator, who can resend it (``SessionService.resend_outbox``)."""
        return
