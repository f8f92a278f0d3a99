"""The leases and timers a sweep hands on (``torpor.service.sweeper``): expired leases
recovered, retry and activation timers activated, stopped batch fan-outs resumed, and due
deliveries started."""

from __future__ import annotations

from datetime import datetime

from torpor.ports import Reason, TimerKind
from torpor.service.sweeper_deadlines import SweeperDeadlines
from torpor.service.sweeper_report import SweepReport
from torpor.service.sweeper_requests import BATCH


class SweeperTimers(SweeperDeadlines):
    """Expired leases, retry, activation and fan-out timers, and due deliveries."""

    async def _leases(self, now: datetime, report: SweepReport) -> None:
        index = self.services.index
        names = await index.expired_leases(now=now, limit=BATCH)
        wanted = [(name.removeprefix("session:"), Reason.RECOVER) for name in names]
        for name, taken in zip(names, await self._request_all(wanted, net=True), strict=True):
            # Forgotten only once a recovery was taken: one that was not finds the entry
            # again next sweep. If the recovery took the lease, its expiry moved past
            # ``now`` and this does nothing.
            if taken:
                await index.forget_lease(name=name, now=now)
        report.recovered += len(names)

    async def _retries(self, now: datetime, report: SweepReport) -> None:
        index, until = self.services.index, now + self.timer_lease
        due = await index.lease_due(kind=TimerKind.RETRY, now=now, limit=BATCH, until=until)
        taken = await self._request_all([(sid, Reason.RETRY) for sid in due], net=True)
        for session_id, ok in zip(due, taken, strict=True):
            if ok:  # an activation the session asked for meanwhile moved the timer: kept
                await index.unschedule(kind=TimerKind.RETRY, member=session_id, if_at=until)
        report.retried += len(due)

    async def _activation_timers(self, now: datetime, report: SweepReport) -> None:
        # Leased, never removed here: an activation that ran to its end removes it (its
        # inbox seen), as does one that hands the session to another timer: a retry's
        # backoff (``Retrier``), quarantine, admission's queue, a newer torpor.
        index, until = self.services.index, now + self.timer_lease
        due = await index.lease_due(kind=TimerKind.WAKE, now=now, limit=BATCH, until=until)
        await self._request_all([(sid, Reason.EVENT) for sid in due])
        report.woken += len(due)

    async def _fan_outs(self, now: datetime, report: SweepReport) -> None:
        # Batches whose fan-out stopped (its replica died): resumed from their cursor, in
        # the background. The timer stays until a fan-out completes (it removes it).
        index, until = self.services.index, now + self.timer_lease
        due = await index.lease_due(kind=TimerKind.FANOUT, now=now, limit=BATCH, until=until)
        for batch_id in due:
            self.batches.start_fan_out(batch_id)
        report.fan_outs += len(due)

    async def _deliveries(self, now: datetime, report: SweepReport) -> None:
        # Started, not awaited: a slow receiver never holds up the sweep.
        report.deliveries = await self.deliveries.start_due(now, limit=BATCH)
