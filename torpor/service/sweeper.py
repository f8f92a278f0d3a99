"""One sweep of the reconciler: everything time or failure left undone.

* due SLA deadlines → a timeout activation (the runtime times the session out and
  compensates once);
* waits overdue (2× their expected duration) with no callback → one ``poll`` of the
  external system, then exponential backoff with jitter, capped;
* leases that expired without release (a holder died, e.g. ``kill -9``) → re-activate
  from the last checkpoint;
* retry timers (outbox entries not yet dispatched, agents that asked to retry, requests
  left out under backpressure) and activation timers (``TimerKind.WAKE``: inbox events no
  activation confirmed) → activate;
* due deliveries → handed to the delivery worker, which attempts them in the background;
* a lost or flushed index → rebuilt from the snapshots (``torpor.service.repair``);
* sessions that ended longer ago than ``storage.retention_s`` → deleted with all their
  records, a bounded number per sweep (``RetentionRepository``), and dropped from the
  registry after their objects are gone.

Nothing is consumed before its work is confirmed: a timer is *leased* (pushed out by the
timer lease) when taken and removed only once its activation request was taken; an
expired lease entry is forgotten only then. A request taken is only queued, so each of
those first arms the session's wake-up timer, which only an activation that ran to its
end removes (``_request_all``). Each step is isolated: one that raises is
logged with its traceback and counted, and the others still run. A sweep in which every
step ran is recorded in the index (``/healthz`` reports its age).

The sweep is plain asyncio over the storage protocols and an activator: it runs in the
detached reconciler actor, from ``torpor reconcile``, and in tests with a manual clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from torpor.ports import trouble_of
from torpor.service.sweeper_report import SweepReport
from torpor.service.sweeper_retention import SweeperRetention
from torpor.service.sweeper_tools import POLL_BATCH, POLL_TIMEOUT_S, POLLS_AT_ONCE

__all__ = ["POLLS_AT_ONCE", "POLL_BATCH", "POLL_TIMEOUT_S", "SweepReport", "Sweeper"]

log = logging.getLogger(__name__)

Step = Callable[[datetime, SweepReport], Awaitable[None]]


class Sweeper(SweeperRetention):
    """One sweep: its steps in order, each isolated, and the index repaired when needed.
    Composed of its parts: ``sweeper_requests`` (the shared state and the activations
    asked for), ``sweeper_deadlines``, ``sweeper_timers``, ``sweeper_tools`` (polls and
    tool timers) and ``sweeper_retention``; ``SweepReport`` is ``sweeper_report``'s."""

    def steps(self) -> list[Step]:
        return [
            self._repair_if_needed,
            self._deliveries,
            self._deadlines,
            self._leases,
            self._retries,
            self._activation_timers,
            self._polls,
            self._tool_timers,
            self._retention,
            self._fan_outs,
        ]

    async def sweep_once(self, now: datetime | None = None) -> SweepReport:
        now = now or self.services.clock.now()
        started = time.time()
        report = SweepReport(store_trouble=trouble_of(self.services.store))
        failed = False
        for step in self.steps():
            name = step.__name__.strip("_")
            try:
                await step(now, report)
            except Exception as exc:  # one failing step must not starve the others
                failed = True
                report.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                log.exception("sweep step %s failed", name)
                await self.services.observer.sweep_step_failed(name)
        if not failed:
            await self.services.index.record_sweep(at=now)
            await self.services.observer.sweep_completed(
                started_at=started, duration_s=time.time() - started
            )
        return report

    # -- index repair --------------------------------------------------------------------

    async def _repair_if_needed(self, now: datetime, report: SweepReport) -> None:
        index = self.services.index
        interval = timedelta(seconds=self.services.settings.reconciler.full_repair_interval_s)
        periodic = self._last_full_repair is None or now - self._last_full_repair >= interval
        if await index.is_intact() and not periodic:
            return
        await self.repair(now, report)
        self._last_full_repair = now

    async def repair(self, now: datetime, report: SweepReport) -> None:
        """Rebuild every index entry and timer a session needs, from object storage."""
        sessions, waits, suspended = await self._repair.run(now, report.errors)
        report.repaired_sessions += sessions
        report.repaired_waits += waits
        report.suspended = suspended
