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

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from torpor.backoff import Backoff
from torpor.errors import PluginNotFound, SessionNotFound, SnapshotCorrupt, TorporError
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.lifecycle import SessionState
from torpor.models import WaitingSession
from torpor.ports import Reason, TimerKind, WaitBinding, trouble_of
from torpor.service.batches import BatchService
from torpor.service.coalescing import Fallback, request_activation
from torpor.service.deliveries import DeliveryWorker
from torpor.service.repair import IndexRepair
from torpor.service.replay import GITHUB_REPLAY_TTL
from torpor.service.sessions import IDEMPOTENCY_TTL, SessionService
from torpor.session.runtime import lease_name
from torpor.session.suspend import poll_member
from torpor.settings import Settings
from torpor.tools import LongRunningTool

log = logging.getLogger(__name__)

BATCH = 500
POLL_TIMEOUT_S = 30.0
POLL_BATCH = 64  # polls a sweep takes; the rest are due at the next sweep
POLLS_AT_ONCE = 16
REQUESTS_AT_ONCE = 32  # activation requests a sweep has in flight
DEADLINE_ROUNDS = 8  # batches of due deadlines one ``deadlines_once`` takes at most
# Two seconds' worth at a thousand deadlines a second: a loop every half second catches
# up after a hiccup instead of falling further behind.
DEADLINE_BATCH = 2000


@dataclass
class SweepReport:
    timeouts: int = 0
    polls: int = 0
    poll_hits: int = 0
    recovered: int = 0
    retried: int = 0
    woken: int = 0  # activation timers that fired (the name is part of the report's output)
    deliveries: int = 0
    fan_outs: int = 0  # batch fan-outs resumed
    repaired_waits: int = 0
    repaired_sessions: int = 0
    suspended: int | None = None
    purged: int = 0
    purged_batches: int = 0  # batches deleted whole, past the retention period
    errors: list[str] = field(default_factory=list)
    # What the object store reports is wrong while it serves (``ReportsTrouble``: a local
    # folder whose log no longer checkpoints), as /healthz's warnings: read each sweep so
    # that the reconciler exports it (``torpor_object_store_trouble``) for an alert.
    store_trouble: str | None = None


def lookup_windows(settings: Settings) -> timedelta:
    """How long records stay needed by a lookup that has a window: the submit idempotency
    key, and the replay claims of every webhook source. Retention never deletes inside it."""
    replay = max((3 * s.tolerance_s for s in settings.sources.values()), default=0.0)
    return max(IDEMPOTENCY_TTL, GITHUB_REPLAY_TTL, timedelta(seconds=max(900.0, replay)))


Step = Callable[[datetime, SweepReport], Awaitable[None]]


class Sweeper:
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

    async def deadlines_once(self, now: datetime | None = None) -> int:
        """Only the due SLA deadlines: run far more often than a whole sweep, so a
        deadline is acted on within a fraction of a second (a sweep's other steps can
        wait for the next one). Returns how many sessions were asked to time out."""
        now = now or self.services.clock.now()
        seen: set[str] = set()
        asked = 0
        for _ in range(DEADLINE_ROUNDS):  # a full batch may hide more due behind it
            due = await self.services.index.due_deadlines(now=now, limit=DEADLINE_BATCH)
            fresh = [sid for sid in dict.fromkeys(b.session_id for b in due) if sid not in seen]
            # A set to look in: a list made this quadratic (2,000 due: about 22 ms a round,
            # four rounds a second on the 1,000-deadlines-a-second path).
            wanted = set(fresh)
            live = await self._live([b for b in due if b.session_id in wanted])
            await self._request_all([(sid, Reason.TIMEOUT) for sid in live])
            seen.update(fresh)
            asked += len(live)
            if len(due) < DEADLINE_BATCH or not fresh:
                break
        return asked

    async def _live(self, due: list[WaitBinding]) -> list[str]:
        """The sessions of these due bindings that are not set aside. A QUARANTINED session
        waits for its operator: asked to time out, it never would (four times a second, an
        activation each, until the grace ran out a week later). Its due bindings leave the
        index instead: left there, they came first in every look at the SLA set, and a full
        batch of them hid every later deadline for that week. Nothing needs them: the
        operator's retry times out a wait whose deadline passed from the snapshot alone,
        and an answer still finds the session by its wait's durable correlation record."""
        session_ids = list(dict.fromkeys(b.session_id for b in due))
        if not session_ids:
            return []
        states = await self.services.index.session_states(session_ids)
        aside = {sid for sid in session_ids if states.get(sid) is SessionState.QUARANTINED}
        await self._unbind([b for b in due if b.session_id in aside])
        return [sid for sid in session_ids if sid not in aside]

    async def _unbind(self, bindings: list[WaitBinding]) -> None:
        """Take due bindings out of the index by correlation id (a binding does not name
        its business key; the index frees a key whose holder is gone)."""
        for binding in bindings:
            await self.services.index.unbind(
                tenant=binding.tenant,
                correlation_id=binding.correlation_id,
                business_key=None,
                deadline=binding.deadline,
            )

    # -- activation requests --------------------------------------------------------------

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

    # -- deadlines, leases, timers -------------------------------------------------------

    async def _deadlines(self, now: datetime, report: SweepReport) -> None:
        # A deadline stays in the SLA set until the timed-out session unbinds its wait: a
        # request that is not taken is simply made again by the next sweep.
        due = await self.services.index.due_deadlines(now=now, limit=BATCH)
        by_session: dict[str, list[WaitBinding]] = {}
        for binding in due:
            by_session.setdefault(binding.session_id, []).append(binding)
        gate = asyncio.Semaphore(REQUESTS_AT_ONCE)

        async def waiting(session_id: str) -> bool:
            async with gate:
                return await self._still_waiting(session_id, by_session[session_id])

        checks = await asyncio.gather(*(waiting(sid) for sid in by_session))
        still = [sid for sid, live in zip(by_session, checks, strict=True) if live]
        sessions = await self._live([b for sid in still for b in by_session[sid]])
        await self._request_all([(sid, Reason.TIMEOUT) for sid in sessions])
        report.timeouts += len(sessions)

    async def _still_waiting(self, session_id: str, due: list[WaitBinding]) -> bool:
        """Whether a due binding of the session still names one of its open waits.

        One that does not is left over: its wait was closed by a commit (answered, or a
        fan-in member closed with its group) and the process died before it unbound it.
        It is unbound here; otherwise it would wake the session for nothing at every sweep
        until its grace ran out. Safe because a wait is bound only after the commit that
        opened it, and a correlation id never names a wait again once it closed."""
        try:
            snapshot = await self.services.snapshots.load_waiting(session_id)
        except SessionNotFound:
            # Deleted by retention (it ended; its process died before the unbind): no
            # wait of it is open. Its activation finds nothing to run and unbinds nothing,
            # so, kept, the binding asked for one at every look until its grace ran out.
            await self._unbind(due)
            return False
        except TorporError:
            return True  # cannot tell: the activation decides, as it always did
        open_ids = {w.correlation_id for w in snapshot.waits}
        left_over = [b for b in due if b.correlation_id not in open_ids]
        await self._unbind(left_over)
        return len(left_over) < len(due)

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

    # -- retention -----------------------------------------------------------------------

    async def _retention(self, now: datetime, report: SweepReport) -> None:
        retention, storage = self.services.retention, self.services.settings.storage
        if retention is None:
            return
        done = await retention.sweep(
            now=now,
            keep=timedelta(seconds=storage.retention_s),
            windows=lookup_windows(self.services.settings),
            limit=storage.retention_per_sweep,
        )
        # After the objects: repair cannot undo it. Those purged by an earlier pass too:
        # a reconciler killed (or an index error) between that pass's deletes and these
        # left the index listing a session that is gone, and repair never drops one.
        for tenant, session_id in [*done.purged, *done.forget]:
            crash_point(CrashPoint.RETENTION_PURGED)
            await self.services.index.forget_session(tenant=tenant, session_id=session_id)
            # Its lease's fencing counter too: kept past every release so that tokens
            # only grow, it was one index key for every session ever leased. Nothing
            # takes a purged session's lease again (it has no snapshot to commit).
            await self.services.index.drop_lease(name=lease_name(session_id))
        report.purged += len(done.purged)
        report.purged_batches += done.batches
        report.errors += done.errors

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
