"""One sweep of the reconciler: everything time or failure left undone.

* due SLA deadlines → a timeout activation (the runtime times the session out and
  compensates once);
* waits overdue (2× their expected duration) with no callback → one ``poll`` of the
  external system, then exponential backoff with jitter, capped;
* leases that expired without release (a holder died, e.g. ``kill -9``) → re-activate
  from the last checkpoint;
* retry timers (outbox entries not yet dispatched, agents that asked to retry) and
  activation timers (``TimerKind.WAKE``: inbox events no activation confirmed) → activate;
* a lost or flushed index → rebuilt from the snapshots, so every waiting session can
  still be resumed.

The sweep is plain asyncio over the storage protocols and an activator: it runs in the
detached reconciler actor, from ``torpor reconcile``, and in tests with a manual clock.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from torpor.backoff import Backoff
from torpor.errors import PluginNotFound, SessionNotFound, TorporError
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot
from torpor.ports import Reason, TimerKind
from torpor.service.deliveries import DeliveryWorker
from torpor.service.sessions import SessionService
from torpor.session.suspend import binding_of, poll_member
from torpor.tools import LongRunningTool

log = logging.getLogger(__name__)

BATCH = 500
POLL_TIMEOUT_S = 30.0


@dataclass
class SweepReport:
    timeouts: int = 0
    polls: int = 0
    poll_hits: int = 0
    recovered: int = 0
    retried: int = 0
    woken: int = 0  # activation timers that fired (the name is part of the report's output)
    deliveries: int = 0
    repaired_waits: int = 0
    repaired_sessions: int = 0
    suspended: int | None = None
    errors: list[str] = field(default_factory=list)


class Sweeper:
    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self._last_full_repair: datetime | None = None
        self.deliveries = DeliveryWorker(self.services)

    async def sweep_once(self, now: datetime | None = None) -> SweepReport:
        now = now or self.services.clock.now()
        report = SweepReport()
        steps = (
            self._repair_if_needed,
            self._deliveries,
            self._deadlines,
            self._leases,
            self._retries,
            self._activation_timers,
            self._polls,
        )
        for step in steps:
            try:
                await step(now, report)
            except TorporError as exc:  # one failing step must not starve the others
                report.errors.append(f"{step.__name__}: {exc}")
                log.warning("sweep step %s failed: %s", step.__name__, exc)
        return report

    async def _activate(self, session_id: str, reason: Reason) -> None:
        await self.sessions.activate(session_id, reason=reason)

    # -- deadlines, leases, timers -------------------------------------------------------

    async def _deadlines(self, now: datetime, report: SweepReport) -> None:
        due = await self.services.index.due_deadlines(now=now, limit=BATCH)
        for session_id in dict.fromkeys(b.session_id for b in due):
            await self._activate(session_id, Reason.TIMEOUT)
            report.timeouts += 1

    async def _leases(self, now: datetime, report: SweepReport) -> None:
        index = self.services.index
        for name in await index.expired_leases(now=now, limit=BATCH):
            session_id = name.removeprefix("session:")
            await self._activate(session_id, Reason.RECOVER)
            # If the recovery acquired the lease its expiry moved past ``now`` and this
            # does nothing; otherwise the dead holder's entry is dropped (full repair
            # still finds a RUNNING session nobody holds).
            await index.forget_lease(name=name, now=now)
            report.recovered += 1

    async def _retries(self, now: datetime, report: SweepReport) -> None:
        index = self.services.index
        for session_id in await index.due(kind=TimerKind.RETRY, now=now, limit=BATCH):
            await index.unschedule(kind=TimerKind.RETRY, member=session_id)
            await self._activate(session_id, Reason.RETRY)
            report.retried += 1

    async def _activation_timers(self, now: datetime, report: SweepReport) -> None:
        index = self.services.index
        grace = timedelta(seconds=self.services.settings.reconciler.wake_grace_s)
        for session_id in await index.due(kind=TimerKind.WAKE, now=now, limit=BATCH):
            # Push the timer out rather than drop it: only a finished activation that saw
            # an empty inbox removes it.
            await index.schedule(kind=TimerKind.WAKE, member=session_id, at=now + grace)
            await self._activate(session_id, Reason.EVENT)
            report.woken += 1

    async def _deliveries(self, now: datetime, report: SweepReport) -> None:
        report.deliveries = await self.deliveries.due(now, limit=BATCH)

    # -- polling -------------------------------------------------------------------------

    async def _polls(self, now: datetime, report: SweepReport) -> None:
        due = await self.services.index.due(kind=TimerKind.POLL, now=now, limit=BATCH)
        await asyncio.gather(*(self._poll(member, now, report) for member in due))

    async def _poll(self, member: str, now: datetime, report: SweepReport) -> None:
        index, settings = self.services.index, self.services.settings
        try:
            session_id, correlation_id, attempt_text = member.split("|")
            attempt = int(attempt_text)
        except ValueError:
            await index.unschedule(kind=TimerKind.POLL, member=member)
            return
        try:
            snapshot = await self.services.snapshots.load(session_id)
        except SessionNotFound:
            await index.unschedule(kind=TimerKind.POLL, member=member)
            return
        wait = snapshot.wait_for(correlation_id)
        tool = self._tool(snapshot, wait.tool_name if wait else "")
        if wait is None or snapshot.terminal or tool is None:
            await index.unschedule(kind=TimerKind.POLL, member=member)
            return
        report.polls += 1
        try:
            outcome = await asyncio.wait_for(
                tool.poll(wait, tenant=snapshot.tenant), timeout=POLL_TIMEOUT_S
            )
        except Exception as exc:  # the far side is down: that is what backoff is for
            log.info("poll of %s failed: %s", member, exc)
            outcome = None
        await index.unschedule(kind=TimerKind.POLL, member=member)
        if outcome is not None:
            report.poll_hits += 1
            await self.sessions.deliver(
                InboxEvent.answering(
                    wait,
                    kind=EventKind.POLL,
                    session_id=session_id,
                    source=f"poll:{wait.tool_name}",
                    event_id=outcome.event_id,
                    type=outcome.type,
                    received_at=now,
                    data=outcome.data,
                )
            )
            return
        backoff = Backoff(
            base_s=settings.reconciler.poll_backoff_base_s,
            cap_s=settings.reconciler.poll_backoff_cap_s,
            jitter=0.2,
        )
        delay = backoff.delay_s(attempt)
        await index.schedule(
            kind=TimerKind.POLL,
            member=poll_member(session_id, correlation_id, attempt + 1),
            at=now + timedelta(seconds=delay),
        )

    def _tool(self, snapshot: SessionSnapshot, name: str) -> LongRunningTool | None:
        try:
            tool = self.services.plugins.agent(snapshot.agent.name).tools.get(name)
        except PluginNotFound:
            return None
        return tool if isinstance(tool, LongRunningTool) and tool.can_poll else None

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
        """Rebuild every index entry a live session needs, from the snapshots."""
        index = self.services.index
        grace = timedelta(seconds=self.services.settings.storage.binding_grace_s)
        live = {
            SessionState.PENDING,
            SessionState.RUNNING,
            SessionState.SUSPENDED,
            SessionState.RESUMING,
        }
        suspended = 0
        async for header in self.services.snapshots.list_by_state():
            await index.record_session(
                tenant=header.tenant,
                session_id=header.session_id,
                state=header.state,
                generation=header.generation,
            )
            if header.state not in live:
                continue
            report.repaired_sessions += 1
            if header.state is SessionState.PENDING:
                await self._activate(header.session_id, Reason.SUBMIT)
                continue
            if header.state is SessionState.RUNNING:
                await self._activate(header.session_id, Reason.RECOVER)
                continue
            suspended += 1
            try:
                snapshot = await self.services.snapshots.load(header.session_id)
            except TorporError as exc:
                report.errors.append(f"repair {header.session_id}: {exc}")
                continue
            for wait in snapshot.waits:
                if await index.resolve(
                    tenant=snapshot.tenant, now=now, correlation_id=wait.correlation_id
                ):
                    continue
                binding = binding_of(snapshot, wait)
                await self.services.correlations.record(binding, business_key=wait.business_key)
                await index.bind_wait(binding, business_key=wait.business_key, grace=grace, now=now)
                if self._tool(snapshot, wait.tool_name) is not None:
                    await index.schedule(
                        kind=TimerKind.POLL,
                        member=poll_member(snapshot.session_id, wait.correlation_id, 0),
                        at=max(now, wait.overdue_after),
                    )
                report.repaired_waits += 1
            pending = await self.services.inbox.pending(
                snapshot.session_id, processed=set(snapshot.processed_events)
            )
            if pending or snapshot.pending_outbox():
                await self._activate(snapshot.session_id, Reason.REPAIR)
        report.suspended = suspended
        await index.mark_intact()
