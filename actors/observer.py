"""The observer that feeds Ray metrics (and logs guard alerts)."""

from __future__ import annotations

import logging

from actors import metrics
from torpor.deliveries import Delivery
from torpor.events import InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import OutboxEntry, SessionSnapshot, Wait
from torpor.ports import Observer

log = logging.getLogger("torpor.security")
dead_log = logging.getLogger("torpor.dead_letters")


class RayObserver(Observer):
    async def transitioned(self, snapshot: SessionSnapshot, previous: SessionState) -> None:
        metrics.inc("transitions", {"state": snapshot.state.value})

    async def outbox_dispatched(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        if entry.dispatched_at is not None:
            lag = max(0.0, (entry.dispatched_at - entry.created_at).total_seconds())
            metrics.observe("outbox_lag", lag, {"kind": entry.kind.value})

    async def observed(self, snapshot: SessionSnapshot, event: InboxEvent, why: str) -> None:
        metrics.inc("events", {"verdict": "observed", "reason": why})

    async def applied(self, snapshot: SessionSnapshot, event: InboxEvent) -> None:
        metrics.inc("events", {"verdict": "applied", "reason": event.kind.value})

    async def security_alert(
        self, snapshot: SessionSnapshot, wait: Wait, reasons: list[str]
    ) -> None:
        metrics.inc("alerts", {"tool": wait.tool_name})
        log.warning(
            "guard blocked session %s wait %s (%s): %s",
            snapshot.session_id,
            wait.wait_id,
            wait.tool_name,
            "; ".join(reasons),
            # the session and trace ids come from the activation's log context
            extra={"correlation_id": wait.correlation_id},
        )

    async def webhook_handled(self, source: str, outcome: str, reason: str = "") -> None:
        metrics.inc("webhooks", {"source": source, "outcome": outcome, "reason": reason})

    async def delivery_settled(self, delivery: Delivery) -> None:
        metrics.inc("deliveries", {"outcome": delivery.status.value})

    async def dead_letter(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        metrics.inc("dead_letters", {"kind": entry.kind.value})
        dead_log.error(
            "dead letter in session %s: %s entry %s (%s) gave up after %d attempts: %s",
            snapshot.session_id,
            entry.kind.value,
            entry.entry_id,
            entry.idempotency_key,
            entry.attempts,
            entry.last_error,
        )

    async def sweep_step_failed(self, step: str) -> None:
        metrics.inc("sweep_failures", {"step": step})

    async def sweep_completed(self, *, started_at: float, duration_s: float) -> None:
        metrics.gauge("last_sweep", started_at)
        metrics.observe("sweep_duration", duration_s)

    async def activation_deferred(self, reason: str) -> None:
        metrics.inc("activations_deferred", {"reason": reason})
