"""A work's outcome delivered to its session: written into the session's inbox
(create-only, event id = the work's id), then an activation, the same path a webhook
takes after its inbox write; tried again for a while after a passing fault.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import JsonValue

from actors.config_ref import ConfigRef
from actors.ray_activator import RayActivator
from torpor.backoff import Backoff
from torpor.events import EventKind, InboxEvent
from torpor.service.sessions import SessionService
from torpor.transient import transient
from torpor.work import WORK_SOURCE, WorkOrder, event_type

log = logging.getLogger(__name__)


async def deliver(
    services: Any, config: ConfigRef, order: WorkOrder, outcome: dict[str, JsonValue]
) -> bool:
    """The answer into the session's inbox (create-only, event id = the work's id), then
    an activation: the same path as a webhook's after its inbox write."""
    event = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=order.session_id,
        source=WORK_SOURCE,
        event_id=order.work_id,
        type=event_type(outcome),
        received_at=services.clock.now(),
        correlation_id=order.correlation_id,
        epoch=order.epoch,
        data=outcome,
        trace_id=order.trace_id,
    )
    # Made for this one delivery: no standby set of its own (it would start processes
    # nobody adopts; the replicas' and the reconciler's sets serve the sessions).
    activator = await RayActivator.made(services, config, standbys=False)
    try:
        return await SessionService(services, activator).deliver(event)
    finally:
        # What it started behind the request (a stalled pool channel's host check) ends
        # with it, not mid-way when the watcher exits.
        await activator.close()


# A delivery that met a passing fault (the index or the store not answering for a moment)
# is tried again for about half a minute: given up at once, the recorded outcome waited
# for the reconciler's poll, at twice the work's expected duration (hours for a job).
DELIVER_ATTEMPTS = 6
DELIVER_BACKOFF = Backoff(base_s=0.5, cap_s=10.0)


async def deliver_patiently(
    services: Any, config: ConfigRef, order: WorkOrder, outcome: dict[str, JsonValue]
) -> None:
    """``deliver``, again after a retryable failure; one that stored the event and failed
    at the activation is woken by the next attempt (the event is already in the inbox)."""
    for attempt in range(DELIVER_ATTEMPTS):
        try:
            if await deliver(services, config, order, outcome) or attempt == 0:
                return
            activator = await RayActivator.made(services, config, standbys=False)
            try:
                await SessionService(services, activator).activate_for_event(order.session_id)
            finally:
                await activator.close()
            return
        except Exception as exc:
            retryable = bool(getattr(exc, "retryable", False)) or transient(exc)
            if not retryable or attempt + 1 == DELIVER_ATTEMPTS:
                raise
            log.warning(
                "work %s: delivering its outcome failed (%s), trying again",
                order.work_id,
                type(exc).__name__,
            )
            await asyncio.sleep(DELIVER_BACKOFF.delay_s(attempt))
