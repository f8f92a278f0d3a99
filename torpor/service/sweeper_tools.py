"""The timers a wait's long-running tool keeps (``torpor.service.sweeper``): its polls of
the external system (backed off while unanswered) and its own timers (an approval's
reminders and escalations), each delivered as an inbox event; a timer of a session set
aside undecodable is dropped once."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta

from torpor.backoff import Backoff
from torpor.errors import PluginNotFound, SessionNotFound, SnapshotCorrupt
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.lifecycle import SessionState
from torpor.models import WaitingSession
from torpor.ports import TimerKind
from torpor.service.sweeper_report import SweepReport
from torpor.service.sweeper_requests import BATCH
from torpor.service.sweeper_timers import SweeperTimers
from torpor.session.suspend import poll_member
from torpor.tools import LongRunningTool

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 30.0
POLL_BATCH = 64  # polls a sweep takes; the rest are due at the next sweep
POLLS_AT_ONCE = 16


class SweeperTools(SweeperTimers):
    """A long-running tool's polls and timers."""

    # -- polling -------------------------------------------------------------------------

    async def _polls(self, now: datetime, report: SweepReport) -> None:
        # Taken, not only read: a second reconciler (a restarted one beside the old) read
        # the same due entries and asked the vendor the same question at the same time.
        # The lease covers the rounds a batch takes at POLLS_AT_ONCE; each poll moves its
        # entry on (the backoff) or off (answered), and one whose poller died is due again.
        until = now + timedelta(seconds=POLL_TIMEOUT_S * (POLL_BATCH // POLLS_AT_ONCE + 1))
        due = await self.services.index.lease_due(
            kind=TimerKind.POLL, now=now, limit=POLL_BATCH, until=until
        )
        if due:
            crash_point(CrashPoint.POLLS_LEASED)
        # A bounded number at once: 500 polls of 30 s each to one slow vendor were all in
        # flight together.
        slots = asyncio.Semaphore(POLLS_AT_ONCE)

        async def one(member: str) -> None:
            async with slots:
                await self._poll_alone(member, now, until, report)

        await asyncio.gather(*(one(member) for member in due))

    async def _poll_alone(
        self, member: str, now: datetime, until: datetime, report: SweepReport
    ) -> None:
        """One poll on its own: a snapshot that cannot be read (damaged, or a newer
        torpor's mid-upgrade) raised out of the step at every sweep, and no sweep was
        recorded complete again. It is named in the report; its timer stays due."""
        try:
            await self._poll(member, now, until, report)
        except Exception as exc:
            log.exception("poll %s failed", member)
            report.errors.append(f"poll {member}: {type(exc).__name__}: {exc}")

    async def _poll(self, member: str, now: datetime, until: datetime, report: SweepReport) -> None:
        index, settings = self.services.index, self.services.settings
        session_id, _, correlation_id = member.partition("|")
        # An entry of an older build carries a poll count other than 0 as its third
        # part: moved on under the wait's own name (``poll_member``) at its next poll.
        correlation_id = correlation_id.partition("|")[0]
        if not session_id or not correlation_id:
            await index.unschedule(kind=TimerKind.POLL, member=member)
            return
        try:
            snapshot = await self.services.snapshots.load_waiting(session_id)
        except SessionNotFound:
            await index.unschedule(kind=TimerKind.POLL, member=member)
            return
        except SnapshotCorrupt:
            if not await self._drop_set_aside(TimerKind.POLL, member, session_id, until):
                raise  # not set aside yet: named in the report, and due again
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
        if outcome is not None:
            report.poll_hits += 1
            # Received now, not at the sweep's start: the steps before and the poll itself
            # may have taken the time past the deadline, and the SLA gate must see that.
            received_at = max(now, self.services.clock.now())
            await self.sessions.deliver(
                InboxEvent.answering(
                    wait,
                    kind=EventKind.POLL,
                    session_id=session_id,
                    source=f"poll:{wait.tool_name}",
                    event_id=outcome.event_id,
                    type=outcome.type,
                    received_at=received_at,
                    data=outcome.data,
                )
            )
            await index.unschedule(kind=TimerKind.POLL, member=member)  # the answer is durable
            return
        backoff = Backoff(
            base_s=settings.reconciler.poll_backoff_base_s,
            cap_s=settings.reconciler.poll_backoff_cap_s,
            jitter=0.2,
        )
        # The count of polls so far is the time since the first one was due: the wait
        # holds that, the entry need not (``poll_member``).
        attempt = backoff.attempt_at((now - wait.overdue_after).total_seconds())
        delay = backoff.delay_s(attempt)
        # The entry is moved, not replaced: nothing is left between two writes.
        own = poll_member(session_id, correlation_id)
        await index.schedule(kind=TimerKind.POLL, member=own, at=now + timedelta(seconds=delay))
        if member != own:  # an older build's entry: the moved one replaces it
            await index.unschedule(kind=TimerKind.POLL, member=member)

    # -- tool timers (an approval's reminders and escalations) -----------------------------

    async def _tool_timers(self, now: datetime, report: SweepReport) -> None:
        index, until = self.services.index, now + self.timer_lease
        due = await index.lease_due(kind=TimerKind.TOOL, now=now, limit=BATCH, until=until)
        for member in due:
            # One at a time, each on its own: a snapshot that cannot be read (damaged, or
            # a newer torpor's mid-upgrade) raised out of the loop at its member, and
            # every timer after it, leased already, was never delivered, at every sweep.
            # It stays leased, and comes back after the lease as any unconfirmed one;
            # unless its session is set aside undecodable (``_drop_set_aside``).
            try:
                await self._tool_timer(member, now, until)
            except Exception as exc:
                log.exception("tool timer %s failed", member)
                report.errors.append(f"tool timer {member}: {type(exc).__name__}: {exc}")

    async def _tool_timer(self, member: str, now: datetime, until: datetime) -> None:
        """The timer becomes an inbox event addressed to its wait (create-only by its name,
        so a sweep that dies after the write and takes the timer again delivers it once),
        and the wait's tool reviews it in the session, under the session's lease. It is
        removed only once the event is durable."""
        index = self.services.index
        session_id, correlation_id, name = [*member.split("|", 2), "", ""][:3]
        try:
            snapshot = await self.services.snapshots.load_waiting(session_id)
        except SessionNotFound:
            snapshot = None
        except SnapshotCorrupt:
            if not await self._drop_set_aside(TimerKind.TOOL, member, session_id, until):
                raise  # not set aside yet: named in the report, and due again
            return
        wait = snapshot.wait_for(correlation_id) if snapshot is not None else None
        if snapshot is not None and wait is not None and not snapshot.terminal and name:
            await self.sessions.deliver(
                InboxEvent.answering(
                    wait,
                    kind=EventKind.TOOL_TIMER,
                    session_id=session_id,
                    source="torpor",
                    event_id=f"timer:{name}:{correlation_id}",
                    type=f"torpor.timer.{name}",
                    received_at=now,
                    data={"timer": name},
                )
            )
        await index.unschedule(kind=TimerKind.TOOL, member=member, if_at=until)

    async def _drop_set_aside(
        self, kind: TimerKind, member: str, session_id: str, until: datetime
    ) -> bool:
        """Drop the leased timer ``member`` of a session whose snapshot does not decode,
        if the registry holds it QUARANTINED; whether it did. Set aside for an operator
        (its activation found it undecodable and said so), no activation runs it: the
        entry came back after every lease, an error logged each time, for as long as
        nobody restored it. Dropped once, with one warning, and put back by the
        operator's retry once the snapshot reads (``quarantine.retry``). Only if still
        leased by this sweep (``if_at``): a retry that re-armed it meanwhile moved it,
        and its entry stays."""
        states = await self.services.index.session_states([session_id])
        if states.get(session_id) is not SessionState.QUARANTINED:
            return False
        await self.services.index.unschedule(kind=kind, member=member, if_at=until)
        log.warning("%s timer %s dropped: its session is set aside, undecodable", kind, member)
        return True

    def _tool(self, snapshot: WaitingSession, name: str) -> LongRunningTool | None:
        try:
            tool = self.services.plugins.agent(snapshot.agent.name).tools.get(name)
        except PluginNotFound:
            return None
        return tool if isinstance(tool, LongRunningTool) and tool.can_poll else None
