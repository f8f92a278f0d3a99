"""The sweep's shared state (``torpor.service.sweeper``): what every part of it uses, how
long a taken timer waits for its work to be confirmed, and the activations it asks for
(a bounded number at once; one not taken leaves a retry timer behind)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from torpor.ports import Reason, TimerKind
from torpor.service.batches import BatchService
from torpor.service.coalescing import Fallback, request_activation
from torpor.service.deliveries import DeliveryWorker
from torpor.service.repair import IndexRepair
from torpor.service.sessions import SessionService

BATCH = 500
REQUESTS_AT_ONCE = 32  # activation requests a sweep has in flight


class SweeperRequests:
    """What every part of the sweep shares, and the activations it asks for."""

    def __init__(self, sessions: SessionService, deliveries: DeliveryWorker | None = None) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self._last_full_repair: datetime | None = None
        self.deliveries = deliveries or DeliveryWorker(self.services)
        self._fallback = Fallback.of(self.services)
        self._repair = IndexRepair(self.services, self._request_all)
        self.batches = BatchService(sessions)

    @property
    def timer_lease(self) -> timedelta:
        """How long a taken timer waits for its work to be confirmed before it is due
        again."""
        return timedelta(seconds=self.services.settings.reconciler.wake_grace_s)

    async def _request_all(
        self, wanted: list[tuple[str, Reason]], *, net: bool = False
    ) -> list[bool]:
        """Ask for these activations, a bounded number at once; True where one was taken.
        One not taken leaves a retry timer behind (the caller may also keep its own).

        ``net``: for a caller that lets go of what made it ask once the request is taken
        (a retry timer, an expired lease's entry, a lost index's repair). Taken means
        queued, not run: a pool host that took the request off its channel and died
        before it leased the session lost it, and with nothing left to ask again the
        session stayed RUNNING for ever (seen in the chaos run). Each such request first
        makes sure of a wake-up timer within the grace, which only an activation that
        ran to its end removes (as for an answer's)."""
        gate = asyncio.Semaphore(REQUESTS_AT_ONCE)
        activator = self.sessions.activator
        grace = timedelta(seconds=self.services.settings.reconciler.wake_grace_s)

        async def one(session_id: str, reason: Reason) -> bool:
            async with gate:
                if net:
                    await self.services.index.schedule(
                        kind=TimerKind.WAKE,
                        member=session_id,
                        at=self.services.clock.now() + grace,
                        keep_earlier=True,
                    )
                taken = await request_activation(activator, session_id, reason, None)
            if not taken:
                await self._fallback.arm(session_id, "request_failed")
            return taken

        return list(await asyncio.gather(*(one(sid, why) for sid, why in wanted)))
