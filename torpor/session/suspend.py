"""Leaving an activation: suspend (open waits, bind them, send their requests) or finish.

Both end the same way: one commit records the new state together with the outbox entries
it makes necessary, and only then does anything leave the process. On suspend the index is
bound before the request is sent, so a callback can never arrive before the index knows
its wait; on finish the waits are unbound after the commit that closed them.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from pydantic import JsonValue

from torpor import fanin, outbox
from torpor.clock import trunc_ms
from torpor.errors import BusinessKeyInUse, SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ids import new_correlation_id, new_wait_id
from torpor.lifecycle import SessionState
from torpor.models import (
    DispatchStatus,
    ErrorInfo,
    FanIn,
    FanInSpec,
    Message,
    OutboxEntry,
    OutboxKind,
    SessionSnapshot,
    ToolCall,
    ToolCallFunction,
    Wait,
    WaitingSession,
)
from torpor.plugins import LoadedAgent
from torpor.ports import TimerIndex, TimerKind, WaitBinding
from torpor.session.working import WorkingCopy, error_result, message_content
from torpor.tools import LongRunningTool, MemberPlan, ToolRegistry, WaitPlan

log = logging.getLogger(__name__)


def binding_of(snapshot: SessionSnapshot | WaitingSession, wait: Wait) -> WaitBinding:
    """What the index and the correlation record know about ``wait``."""
    return WaitBinding(
        tenant=snapshot.tenant,
        correlation_id=wait.correlation_id,
        session_id=snapshot.session_id,
        epoch=wait.epoch,
        step_id=wait.waiting_step_id,
        deadline=wait.deadline,
    )


def unsent_starts(snapshot: SessionSnapshot | WaitingSession) -> set[str | None]:
    """The waits whose request is still to be sent (by correlation id). A wait's durable
    record and index entry are written before its request goes out (``bind_waits``):
    any other open wait has both, the record for good."""
    return {
        e.correlation_id
        for e in snapshot.outbox
        if e.kind is OutboxKind.START and e.status is DispatchStatus.PENDING
    }


def _call_of(wait: Wait) -> ToolCall:
    """The tool call ``wait`` answers, as a reissue plans it again."""
    return ToolCall(id=wait.tool_call_id, function=ToolCallFunction(name=wait.tool_name))


def tool_timer_member(session_id: str, correlation_id: str, name: str) -> str:
    """The TOOL timer entry of a wait: who, which wait, which of its tool's timers."""
    return f"{session_id}|{correlation_id}|{name}"


async def schedule_tool_timers(
    index: TimerIndex,
    session_id: str,
    wait: Wait,
    tool: LongRunningTool,
    *,
    if_absent: bool = False,
    keep_earlier: bool = False,
    after: datetime | None = None,
) -> None:
    """The wait's tool timers; with ``if_absent`` each only where it is missing (repair:
    one that exists may be leased, a taker at work on it); with ``keep_earlier`` one that
    exists is moved to its time only if that is earlier (the operator's retry: one leased
    by a sweep is due again, and that sweep's ``if_at`` removal leaves it); with ``after``
    only those due later (most earlier ones fired and were removed: put back, each fires
    again)."""
    for timer in tool.timers(wait):
        if after is not None and timer.at <= after:
            continue
        member = tool_timer_member(session_id, wait.correlation_id, timer.name)
        await index.schedule(
            kind=TimerKind.TOOL,
            member=member,
            at=timer.at,
            if_absent=if_absent,
            keep_earlier=keep_earlier,
        )


def poll_member(session_id: str, correlation_id: str) -> str:
    """The POLL timer entry of a wait: who, which wait. One entry a wait, moved on at
    each poll, so repair can make sure it exists (``if_absent``) without starting a
    second chain of polls or pulling a backed-off one earlier. The third part was the
    poll count, and stays ``0``: a reconciler of an older build, mid-upgrade, reads it
    as a first poll (and writes ``|1``, ``|2``...: ``Sweeper`` moves those back here)
    instead of dropping an entry it cannot parse."""
    return f"{session_id}|{correlation_id}|0"


class Suspender:
    """Suspend, finish, and the index and outbox work both owe after their commit."""

    def __init__(self, work: WorkingCopy, loaded: LoadedAgent | None) -> None:
        self.work = work
        self.deps = work.deps
        self.loaded = loaded

    # -- suspend ------------------------------------------------------------------------

    async def suspend(self, plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]]) -> None:
        """One commit: SUSPENDED + the waits + their outbox entries. Then bind, then send."""
        work = self.work
        plans = await self.refuse_taken_keys(self.refuse_repeated_actions(plans))
        if not plans:
            await work.commit()  # the refusals are the calls' answers: the agent goes on
            return
        now = work.now
        epoch = work.snap.epoch + 1  # RUNNING → SUSPENDED opens a wait: the epoch moves on
        waits: list[Wait] = []
        groups: list[FanIn] = []
        single: list[Wait] = []
        for call, tool, plan in plans:
            if not plan.members:
                single.append(self.open_wait(call, tool, plan, epoch))
                continue
            # One tool asked for several answers: one wait per member, one group, one
            # aggregated result for the call.
            group, members = fanin.form(
                plan.fan_in or FanInSpec(),
                [self.open_wait(call, tool, plan, epoch, member=m) for m in plan.members],
                labels=[m.label for m in plan.members],
                aggregate_call_id=call.id,
            )
            groups.append(group)
            waits += members
        if len(single) > 1:
            # Several long-running calls in one turn: the session sleeps once, until the
            # agent's fan-in condition over them is met.
            spec = self.loaded.config.fan_in if self.loaded else FanInSpec()
            group, single = fanin.form(spec, single)
            groups.append(group)
        waits = single + waits
        used = {w.business_key: epoch for w in waits if w.business_key is not None}
        work.move(SessionState.SUSPENDED, "waiting for " + ", ".join(w.tool_name for w in waits))
        assert work.snap.epoch == epoch
        entries = [outbox.start_entry(work.snap, w, now=now) for w in waits]
        entries += self.notifications("suspended")
        work.update(
            waits=waits,
            fan_ins=groups,
            outbox=[*work.snap.outbox, *entries],
            business_keys={**work.snap.business_keys, **used},
        )
        await work.commit()
        crash_point(CrashPoint.SUSPEND_COMMITTED)
        await self.complete_suspend()

    def refuse_repeated_actions(
        self, plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]]
    ) -> list[tuple[ToolCall, LongRunningTool, WaitPlan]]:
        """Fail each call that asks for an action an earlier call of this turn asked for
        (an agent that repeats a call): both requests would go out under the one key
        ``tenant:action_key:epoch``, which the far side dedups into one request answered
        once, so the repeat's wait would never be answered (nor its group met). The
        refusal is the call's tool message; the first call's wait stays."""
        work = self.work
        seen: set[str] = set()
        kept: list[tuple[ToolCall, LongRunningTool, WaitPlan]] = []
        for call, tool, plan in plans:
            actions = [m.action_key for m in plan.members] or [plan.action_key]
            repeated = [a for a in actions if a in seen]
            if not repeated:
                seen.update(actions)
                kept.append((call, tool, plan))
                continue
            error = error_result(
                f"action {repeated[0]!r} is already asked for by another call of this turn",
                code="action_repeated",
            )
            work.update(
                messages=[
                    *work.snap.messages,
                    Message(role="tool", tool_call_id=call.id, content=message_content(error)),
                ]
            )
        return kept

    async def refuse_taken_keys(
        self, plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]]
    ) -> list[tuple[ToolCall, LongRunningTool, WaitPlan]]:
        """Fail each call whose business key another session's open wait in the tenant
        holds (a business-key-only webhook could not tell the two apart); keep the rest.
        The refusal is the call's tool message, committed with whatever the turn does
        next. A key this session holds itself is a re-plan: a new epoch of its own wait."""
        work = self.work
        kept: list[tuple[ToolCall, LongRunningTool, WaitPlan]] = []
        for call, tool, plan in plans:
            # A fan-in plan routes by each member's key as well as the plan's own.
            keys = [plan.business_key, *(m.business_key for m in plan.members)]
            taken = [k for k in keys if k is not None and await self.key_holder(k) is not None]
            if not taken:
                kept.append((call, tool, plan))
                continue
            error = BusinessKeyInUse(
                f"business key {taken[0]!r} is held by an open wait of another "
                "session in this tenant"
            )
            work.update(
                messages=[
                    *work.snap.messages,
                    Message(
                        role="tool",
                        tool_call_id=call.id,
                        content=message_content(error_result(error)),
                    ),
                ]
            )
        return kept

    async def key_holder(self, business_key: str | None) -> str | None:
        """The other session whose open wait holds ``business_key``, if any."""
        snap = self.work.snap
        if business_key is None:
            return None
        found = await self.deps.index.resolve(
            tenant=snap.tenant, now=self.work.now, business_key=business_key
        )
        if found is None or found.session_id == snap.session_id:
            return None
        # The index may keep a pointer its session never removed (it died between the
        # commit that closed the wait and the unbind): the holder's snapshot decides, and
        # a pointer to a closed wait is dropped rather than refusing a valid call. Its
        # waits only: the whole holder is all its history, chunk by chunk.
        try:
            holder = await self.deps.snapshots.load_waiting(found.session_id)
        except SessionNotFound:
            holder = None
        if holder is None or holder.wait_for(found.correlation_id) is None:
            await self.deps.index.unbind(
                tenant=snap.tenant,
                correlation_id=found.correlation_id,
                business_key=business_key,
                deadline=found.deadline,
            )
            return None
        return found.session_id

    def open_wait(
        self,
        call: ToolCall,
        tool: LongRunningTool,
        plan: WaitPlan,
        epoch: int,
        *,
        member: MemberPlan | None = None,
    ) -> Wait:
        """The wait ``plan`` asks for, or the one of its fan-in ``member``: the member's
        own request and route, the plan's settings where the member leaves them unset."""
        work, now = self.work, self.work.now
        business_key = member.business_key if member else plan.business_key
        sla_s = member.sla_s if member and member.sla_s is not None else plan.sla_s
        return Wait(
            wait_id=new_wait_id(),
            correlation_id=new_correlation_id(),
            business_key=business_key,
            waiting_step_id=str(work.snap.step),
            epoch=epoch,
            action_key=member.action_key if member else plan.action_key,
            tool_name=tool.spec.name,
            tool_call_id=call.id,
            expected_types=plan.expected_types,
            allowed_sources=(member.allowed_sources if member else [])
            or self.answer_sources(tool, plan),
            sources_declared=True,
            opened_at=now,
            deadline=trunc_ms(now + timedelta(seconds=sla_s)),
            expected_duration_s=plan.expected_duration_s,
            guard=(member.guard if member else None) or plan.guard,
            on_drift=plan.on_drift,
            request=member.request if member else plan.request,
            replanned=business_key is not None and business_key in work.snap.business_keys,
            progress=plan.progress,
        )

    async def reissue(
        self,
        wait: Wait,
        tool: LongRunningTool,
        request: dict[str, JsonValue],
        *,
        reason: str,
        withdraw: bool = True,
    ) -> None:
        """Withdraw ``wait``'s request and send ``request`` in its place, in a new epoch:
        the old wait closes (RUNNING, its compensation withdraws the request under its own
        idempotency key), the new one opens (SUSPENDED, a new correlation id) in the same
        commit, so an answer to the old request is stale from then on. The SLA deadline
        stays the wait's."""
        work = self.work
        work.update(
            waits=[w for w in work.snap.waits if w.wait_id != wait.wait_id],
            outbox=[*work.snap.outbox, *self._withdrawal(wait, tool, reason, withdraw)],
        )
        work.move(SessionState.RUNNING, reason)
        await self.suspend([(_call_of(wait), tool, self._replacement(wait, request))])
        await self.unbind([wait])

    def reopen(
        self,
        wait: Wait,
        tool: LongRunningTool,
        request: dict[str, JsonValue],
        *,
        reason: str,
        withdraw: bool = True,
    ) -> Wait:
        """Withdraw ``wait``'s request and owe ``request`` in its place, in the session's
        epoch: ``reissue`` moves the epoch, which would strand the session's other waits
        (their bindings and in-flight answers carry it). The new wait (a new correlation
        id, the old one's deadline, step and group) takes the old one's place in the
        working copy with its START entry; the caller commits, then unbinds the old wait
        and binds the new one before the request is sent (``complete_suspend``)."""
        work = self.work
        new = self.open_wait(_call_of(wait), tool, self._replacement(wait, request), wait.epoch)
        new = new.model_copy(
            update={
                "waiting_step_id": wait.waiting_step_id,
                "deadline": wait.deadline,
                "group_id": wait.group_id,
                # another request of the same call in the same epoch: its own key
                "reissued": wait.reissued + 1,
            }
        )
        work.update(
            waits=[new if w.wait_id == wait.wait_id else w for w in work.snap.waits],
            outbox=[
                *work.snap.outbox,
                *self._withdrawal(wait, tool, reason, withdraw),
                outbox.start_entry(work.snap, new, now=work.now),
            ],
        )
        return new

    def _withdrawal(
        self, wait: Wait, tool: LongRunningTool, reason: str, withdraw: bool
    ) -> list[OutboxEntry]:
        """The undo of ``wait``'s request that a reissue owes, if asked for and the tool
        can undo."""
        if not (withdraw and tool.can_compensate):
            return []
        return [outbox.compensate_entry(self.work.snap, wait, reason=reason, now=self.work.now)]

    def _replacement(self, wait: Wait, request: dict[str, JsonValue]) -> WaitPlan:
        """The plan of ``wait`` with ``request`` in place of its own: the deadline, route
        and tool state stay the wait's."""
        return WaitPlan(
            action_key=wait.action_key,
            request=request,
            business_key=wait.business_key,
            sla_s=max(0.001, (wait.deadline - self.work.now).total_seconds()),
            expected_duration_s=wait.expected_duration_s,
            expected_types=wait.expected_types,
            allowed_sources=wait.allowed_sources,
            guard=wait.guard,
            on_drift=wait.on_drift,
            progress=wait.progress,
        )

    def answer_sources(self, tool: LongRunningTool, plan: WaitPlan) -> list[str]:
        """Who may answer the wait: the plan's sources, else the agent's configuration for
        the tool, else the tool's ``answered_by``. Empty: torpor's own events only."""
        if plan.allowed_sources:
            return plan.allowed_sources
        configured = self.loaded.config.answer_sources if self.loaded else {}
        return list(configured.get(tool.spec.name) or tool.answered_by)

    async def complete_suspend(self) -> None:
        """Bind, then send: also what finishes a suspend that crashed after its commit."""
        await self.bind_waits()
        crash_point(CrashPoint.WAITS_BOUND)
        await self.drain_outbox()

    async def bind_waits(self) -> None:
        """Durable correlation record first, then the index: a callback that races the
        index still finds its session through the record."""
        snap = self.work.snap
        pending_starts = unsent_starts(snap)
        grace = self.deps.config.binding_grace
        for wait in snap.waits:
            if wait.correlation_id not in pending_starts:
                continue
            binding = binding_of(snap, wait)
            await self.deps.correlations.record(binding, business_key=None)
            took_key = await self.deps.index.bind_wait(
                binding, business_key=wait.business_key, grace=grace, now=self.work.now
            )
            if wait.business_key is not None and took_key:
                # The durable pointer follows the index's decision, so a fallback lookup
                # after a Redis miss routes where the index did.
                await self.deps.correlations.record_business_key(
                    binding, business_key=wait.business_key
                )
            elif wait.business_key is not None:
                # Another session bound the same key between our check and our bind: it
                # keeps the key, and this wait is answered by its correlation id only.
                log.warning(
                    "business key of wait %s is held by another session: it routes by "
                    "correlation id only",
                    wait.correlation_id,
                )
            tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
            if isinstance(tool, LongRunningTool) and tool.can_poll:
                await self.deps.index.schedule(
                    kind=TimerKind.POLL,
                    member=poll_member(snap.session_id, wait.correlation_id),
                    at=wait.overdue_after,
                )
            if isinstance(tool, LongRunningTool):
                await schedule_tool_timers(self.deps.index, snap.session_id, wait, tool)

    async def unbind(self, waits: list[Wait]) -> None:
        for wait in waits:
            await self.deps.index.unbind(
                tenant=self.work.snap.tenant,
                correlation_id=wait.correlation_id,
                business_key=wait.business_key,
                deadline=wait.deadline,
            )

    # -- outbox -------------------------------------------------------------------------

    async def drain_outbox(self) -> None:
        """Send every due entry; commit the new statuses once; then raise what gave up:
        dead letters to the observer, failed requests to their waits."""
        work = self.work
        due = [e for e in work.snap.outbox if outbox.is_due(e, work.now)]
        if not due:
            return
        settled: dict[str, OutboxEntry] = {}
        for entry in due:
            if self.loaded is None and entry.kind is not OutboxKind.NOTIFY:
                # Its tool is the agent's, not configured here: left for a node that has
                # it. A notice needs none: a session that ended for want of its agent
                # still tells its submitter so.
                continue
            result = await outbox.send(
                entry,
                work.snap,
                tools=self.loaded.tools if self.loaded else ToolRegistry(),
                router=self.deps.router,
                notifier=self.deps.notifier,
                now=work.now,
            )
            if isinstance(result, outbox.Sent):
                crash_point(f"outbox.sent.{entry.kind.value}")
            new = outbox.settle(entry, result, now=work.now)
            settled[entry.entry_id] = new
            if isinstance(result, outbox.RetryAt):
                await self.deps.index.schedule(
                    kind=TimerKind.RETRY, member=work.snap.session_id, at=result.at
                )
        work.update(outbox=[settled.get(e.entry_id, e) for e in work.snap.outbox])
        await work.commit()
        for entry in settled.values():
            if entry.status is DispatchStatus.DISPATCHED:
                await self.deps.observer.outbox_dispatched(work.snap, entry)
            if entry.status is DispatchStatus.DEAD:
                # The entry itself is the durable record (it stays in the outbox until an
                # operator resends it); this hook is the alert and the metric.
                await self.deps.observer.dead_letter(work.snap, entry)
        if any(e.status is DispatchStatus.FAILED for e in settled.values()):
            crash_point(CrashPoint.START_FAILED)
        await self.report_failed_starts()

    async def report_failed_starts(self) -> None:
        """Answer every open wait whose request could never be sent, through the inbox,
        so the agent sees the failure like any other result.

        Derived from the snapshot alone (a FAILED start whose wait is still open and whose
        answer was never processed), and the inbox write is create-only by event id: if
        the process dies between the commit that settled the start and this write, the
        next activation (or the reconciler's) writes it, once."""
        snap = self.work.snap
        processed = set(snap.processed_events)
        for entry in snap.outbox:
            if entry.kind is not OutboxKind.START or entry.status is not DispatchStatus.FAILED:
                continue
            wait = snap.wait_for(entry.correlation_id or "")
            if wait is None:
                continue
            event = InboxEvent.answering(
                wait,
                kind=EventKind.DISPATCH_FAILED,
                session_id=snap.session_id,
                source="torpor",
                event_id=f"dispatch-failed:{wait.correlation_id}",
                type="torpor.dispatch.failed",
                received_at=self.work.now,
                data={"status": "error", "error": "the request could not be sent"},
            )
            if event.key not in processed:
                await self.deps.inbox.deliver(event)

    # -- finish -------------------------------------------------------------------------

    async def finish(
        self,
        target: SessionState,
        *,
        reason: str,
        result: JsonValue = None,
        error: ErrorInfo | None = None,
        compensate: list[Wait] | None = None,
        closed: list[Wait] | None = None,
    ) -> None:
        """End the session: one commit with the compensations and the terminal notice,
        then unbind the closed waits, then send.

        ``closed``: waits the caller already took out of the snapshot in this activation
        (fan-in members answered, expired or cancelled on the way) and has not unbound
        yet; they are unbound with the rest, since no later commit of this session will."""
        work = self.work
        closing = [*(closed or []), *work.snap.waits]
        entries = [
            outbox.compensate_entry(work.snap, w, reason=reason, now=work.now)
            for w in (compensate or [])
            if self._can_compensate(w)
        ]
        # A request still owed is never sent now (its wait is closed); it is undone all
        # the same, as one that went out: even one never marked tried may have (a crash
        # between its send and the commit of its status), and an undo the far side finds
        # nothing for costs less than a request left open for a session that ended.
        unsent = unsent_starts(work.snap)
        owed = [
            outbox.withdraw(e, reason=f"not sent: the session ended first ({reason})")
            if e.kind is OutboxKind.START and e.correlation_id in unsent
            else e
            for e in work.snap.outbox
        ]
        work.move(target, reason)
        work.update(waits=[], fan_ins=[], result=result, error=error, outbox=[*owed, *entries])
        if "terminal" in self.deps.config.notify_on and work.snap.callback_url:
            work.update(
                outbox=[
                    *work.snap.outbox,
                    outbox.notify_entry(work.snap, event=target.value, now=work.now),
                ]
            )
        await work.commit(beside=lambda: self.unbind(closing))  # one round trip for both
        await self.drain_outbox()

    def notifications(self, event: str) -> list[OutboxEntry]:
        """NOTIFY entries for a non-terminal event the deployment notifies on."""
        snap = self.work.snap
        if event not in self.deps.config.notify_on or not snap.callback_url:
            return []
        return [outbox.notify_entry(snap, event=event, now=self.work.now)]

    def _can_compensate(self, wait: Wait) -> bool:
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        return isinstance(tool, LongRunningTool) and tool.can_compensate
