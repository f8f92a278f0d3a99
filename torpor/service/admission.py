"""Admission of batch sessions: an activation request takes a running slot first.

Wraps the activator every service asks through (submit, events, the sweeper), so a batch
of 10,000 documents whose approvals land together runs at most ``max_running_per_batch``
of them (and a tenant's batches ``max_running_per_tenant``) at once; no process is
started for the rest. A session past the cap waits durably: its place in the batch's
queue (document order) and, as a safety net, a retry timer ``admission_retry_s`` away;
a session leaving its slot wakes the queue's head (``torpor.session.slots``). A cancel is
never held back: it ends the session, and holding it would keep one of its slots' worth
of work going. A session outside any batch (told by its id's shape) skips the slots: its
activation costs no extra round trip.
"""

from __future__ import annotations

from datetime import timedelta

from torpor.ids import in_batch
from torpor.ports import Activator, Reason, SlotEntry, TimerKind
from torpor.ports.services import Services


class AdmittingActivator:
    def __init__(self, inner: Activator, services: Services) -> None:
        self.inner = inner
        self.services = services
        config = services.config
        # A slot outlives any activation (the wall-time cap, then the lease's expiry): it
        # only ever expires for a holder that died.
        self.ttl = config.activation_cap + config.lease_ttl
        self.retry = timedelta(seconds=services.settings.batches.admission_retry_s)

    @classmethod
    def around(cls, activator: Activator, services: Services) -> Activator:
        if services.slots is None or isinstance(activator, cls):
            return activator
        return cls(activator, services)

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        slots = self.services.slots
        if slots is not None and reason is not Reason.CANCEL and in_batch(session_id):
            entry = await slots.enter(member=session_id, ttl=self.ttl)
            if entry is SlotEntry.WAITING:
                await self._queued(session_id)
                return
        await self.inner.request(session_id, reason=reason, agent=agent)

    async def _queued(self, session_id: str) -> None:
        index, now = self.services.index, self.services.clock.now()
        # The safety net first, then drop the wake-up timer: the queue wakes it sooner,
        # and a wake-up timer would have the reconciler ask for it every round meanwhile.
        await index.schedule(kind=TimerKind.RETRY, member=session_id, at=now + self.retry)
        await index.unschedule(kind=TimerKind.WAKE, member=session_id)
