"""Waking up: apply what the inbox holds to the session's waits, through the gates.

In order: a cancel wins over everything; then each event passes the gates
(``torpor.gates``: epoch/step, dedup, admission, deadline) and either is observed (recorded,
never applied) or reaches the State Invalidation Guard (``torpor.guard``) and is injected as
the answer of its tool call. Waits whose deadline passed time the session out. A finished
session still answers late events, as observations.

A guard whose ``current_state`` fails or times out is retried with the session core's
backoff (``torpor.session.retry``) until the retry quota is spent; once the wait's
deadline has passed it times out instead, so a failing guard can never outlive the SLA.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pydantic import JsonValue

from torpor import guard, outbox
from torpor.deadlines import call_out
from torpor.errors import GuardUnavailable
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.gates import Verdict, classify, expired_waits
from torpor.lifecycle import SessionState
from torpor.models import DriftPolicy, ErrorInfo, Message, Observation, ObservationReason, Wait
from torpor.plugins import LoadedAgent
from torpor.session.fan_in import FanInWake
from torpor.session.retry import Retrier
from torpor.session.suspend import Suspender
from torpor.session.working import WorkingCopy, message_content, quotes_json_text
from torpor.tools import LongRunningTool, Review, ReviewAction


class Wake:
    """The resume phase of one activation."""

    def __init__(
        self,
        work: WorkingCopy,
        loaded: LoadedAgent | None,
        suspender: Suspender,
        *,
        on_running: Callable[[], None] | None = None,
    ) -> None:
        self.work = work
        # Called once the session runs again, before its wake is committed: the agent's
        # next step is called meanwhile (``AgentLoop.step_ahead``).
        self.on_running = on_running
        self.deps = work.deps
        self.loaded = loaded
        self.suspender = suspender
        self.retrier = Retrier(work)
        self._closed: list[Wait] = []  # waits answered by this activation, to unbind
        self.fan_in = FanInWake(work, loaded)
        self._reissue: Review | None = None
        self._reissued: Wait | None = None
        self._reopened = False  # a wait's request was reissued in place: bind, then send

    async def resume(self) -> None:
        """Apply what the inbox holds to the waits, through the gates, in order."""
        work = self.work
        work.inbox_read_at = time.monotonic()
        events = await self.deps.inbox.pending(
            work.snap.session_id, processed=set(work.snap.processed_events)
        )
        now = work.now
        cancel = next((e for e in events if e.kind is EventKind.CANCEL), None)
        if cancel is not None:
            await self._cancel(cancel)
            return
        overdue = expired_waits(work.snap, now=now)
        if not events and not overdue:
            return
        if work.snap.state is SessionState.SUSPENDED:
            work.move(SessionState.RESUMING, "events" if events else "deadline")
        for event in events:
            decision = classify(work.snap, event, processed=set(work.snap.processed_events))
            if decision.verdict is Verdict.OBSERVE:
                await self.observe(event, decision.reason or ObservationReason.STALE)
                continue
            assert decision.wait is not None
            if decision.verdict is Verdict.EXPIRED:
                await self.observe(event, ObservationReason.LATE)
                overdue.append(decision.wait)
                continue
            if self.replaced(decision.wait):
                await self.observe(event, ObservationReason.STALE)
                continue
            review = self.review(event, decision.wait)
            if review is not None and review.action is not ReviewAction.APPLY:
                await self.settle_review(event, decision.wait, review)
                continue
            try:
                applied = await self.apply(event, decision.wait, review)
            except GuardUnavailable as exc:
                if decision.wait.deadline <= now:
                    # The guard cannot be checked and the time is up: the SLA still
                    # holds, so the wait times out instead of retrying past its deadline.
                    await self.observe(event, ObservationReason.LATE)
                    overdue.append(decision.wait)
                    continue
                # The checkpoint commits the waits closed so far (members answered
                # before this one): they are unbound after it, as at the end of resume.
                await self.retrier.later(exc.code, str(exc), beside=self._unbind_closed)
            if not applied:
                return  # the guard ended the session
        # A fan-in member under proceed_with_arrived counts as missing; its group resolves
        # once too few members are left. All of them at once: which overdue member is
        # looked at first must not decide which are expired and which cancelled.
        lapsed = [
            w
            for w in overdue
            if work.snap.wait_for(w.correlation_id) and self.fan_in.proceeds_on_expiry(w)
        ]
        if lapsed:
            self._closed = [*self._closed, *self.fan_in.expired(lapsed)]
        still_open = [w for w in overdue if work.snap.wait_for(w.correlation_id)]
        reissue, reissued = self._reissue, self._reissued
        self._reissue = self._reissued = None
        if (
            reissue is not None
            and reissued is not None
            and not still_open
            and await self.reissue(reissued, reissue)
        ):
            return
        if still_open:
            await self.finish(
                SessionState.TIMED_OUT,
                reason="deadline passed",
                compensate=list(work.snap.waits),
                error=ErrorInfo(
                    code="sla_expired",
                    message="no answer before the deadline",
                    detail={"waits": [w.wait_id for w in still_open]},
                ),
            )
            return
        if work.snap.state is not SessionState.RESUMING:
            return
        if work.snap.waits:
            work.move(SessionState.SUSPENDED)
        else:
            work.move(SessionState.RUNNING)
            work.update(outbox=[*work.snap.outbox, *self.suspender.notifications("resumed")])
            if self.on_running is not None:
                self.on_running()
                # One turn of the loop for the step just called to start (an LLM request
                # is sent) before the commit: a store may write it on this thread, and the
                # step would otherwise wait for the commit's flush (``storage.local_store``).
                await asyncio.sleep(0)
        closed, self._closed = self._closed, []

        async def unbind_closed() -> None:
            crash_point(CrashPoint.WAKE_COMMITTED)
            await self.suspender.unbind(closed)

        # The answered waits are unbound beside the registry's record of the new state:
        # one round trip for both (``WorkingCopy.commit``).
        await work.commit(beside=unbind_closed)
        if self._reopened:
            # A request reissued in place: its new wait is bound before it goes out, as
            # on suspend (a crash in between leaves it to the next activation's).
            await self.suspender.complete_suspend()
        elif work.snap.pending_outbox():
            # compensations of closed fan-in members, a tool's notices (reminders): now
            await self.suspender.drain_outbox()

    async def finish(
        self,
        target: SessionState,
        *,
        reason: str,
        error: ErrorInfo | None,
        compensate: list[Wait] | None = None,
        result: JsonValue = None,
    ) -> None:
        """End the session (``Suspender.finish``) with the waits this activation closed
        before it: they are out of the snapshot but still bound, and the resume's own
        commit, which would unbind them, never comes."""
        closed, self._closed = self._closed, []
        await self.suspender.finish(
            target,
            reason=reason,
            error=error,
            compensate=compensate,
            result=result,
            closed=closed,
        )

    async def _unbind_closed(self) -> None:
        closed, self._closed = self._closed, []
        await self.suspender.unbind(closed)

    async def cancel_first(self) -> bool:
        """End the session now if a cancel waits in the inbox; True if it did. Asked before
        an activation sends what the outbox owes (a request retried after a failure, or
        one a crash left unsent): a cancel accepted meanwhile must stop it going out."""
        cancel = await self.work.pending_cancel()
        if cancel is None:
            return False
        await self._cancel(cancel)
        return True

    async def _cancel(self, cancel: InboxEvent) -> None:
        work = self.work
        work.update(processed_events=[*work.snap.processed_events, cancel.key])
        await self.finish(
            SessionState.CANCELLED,
            reason="cancelled",
            compensate=list(work.snap.waits),
            error=None,
            result=None,
        )

    def tool_of(self, wait: Wait) -> LongRunningTool | None:
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        return tool if isinstance(tool, LongRunningTool) else None

    def review(self, event: InboxEvent, wait: Wait) -> Review | None:
        """The wait's tool's word on an event that passed the gates. An instruction only
        torpor writes (a tool timer, an operator's) for a tool that does not review is
        unexpected: it must never become a tool's answer."""
        tool = self.tool_of(wait)
        review = tool.review(wait, event, now=self.work.now) if tool is not None else None
        if review is None and event.kind in (EventKind.TOOL_TIMER, EventKind.OPERATOR):
            return Review(ReviewAction.OBSERVE, reason=ObservationReason.UNEXPECTED)
        return review

    async def settle_review(self, event: InboxEvent, wait: Wait, review: Review) -> None:
        """Record a reviewed event that does not answer the wait: its observation, the
        wait's new tool state, the tool's notices, an alert; a reissue comes after the
        other events of this activation."""
        work = self.work
        await self.observe(event, review.reason or ObservationReason.UNEXPECTED)
        if review.progress is not None:
            current = work.snap.wait_for(wait.correlation_id) or wait
            updated = current.model_copy(update={"progress": review.progress})
            work.update(
                waits=[updated if w.wait_id == wait.wait_id else w for w in work.snap.waits]
            )
        if review.notices:
            entries = [outbox.notice_entry(work.snap, n, now=work.now) for n in review.notices]
            work.update(outbox=[*work.snap.outbox, *entries])
        if review.alert:
            await self.deps.observer.security_alert(work.snap, wait, review.alert)
        if review.action is not ReviewAction.REISSUE or review.request is None:
            return
        if self._alone(wait) and self.fan_in.group_of(wait) is None:
            self._reissue, self._reissued = review, wait  # after the other events
        else:
            self.reissue_in_place(wait, review)

    def replaced(self, wait: Wait) -> bool:
        """Whether this activation already reissues ``wait`` (a stage decided, an
        escalation, a reassignment): a later event for it answers the request being
        replaced, and is stale, as it would be had the session woken for each event (a
        second vote must not decide the same stage again). Only for a reissue that waits
        for the end of the activation (``reissue``); one done in place has removed the
        wait already, so a later event for it finds none and is stale all the same."""
        reissued = self._reissued
        return reissued is not None and reissued.wait_id == wait.wait_id and self._alone(wait)

    def _alone(self, wait: Wait) -> bool:
        waits = self.work.snap.waits
        return len(waits) == 1 and waits[0].wait_id == wait.wait_id

    async def reissue(self, wait: Wait, review: Review) -> bool:
        """Send the wait's request anew (a new epoch). Only for a session waiting on this
        one wait, outside any group: a reissue closes the session's epoch, which would
        strand its others (and drop a group's answers); those reissue in place."""
        work = self.work
        tool = self.tool_of(wait)
        current = work.snap.wait_for(wait.correlation_id)
        if tool is None or current is None or not self._alone(wait) or review.request is None:
            return False
        await self.suspender.unbind(self._closed)
        self._closed = []
        reason = (review.reason or ObservationReason.ESCALATED).value
        await self.suspender.reissue(
            current, tool, review.request, reason=reason, withdraw=review.withdraw
        )
        return True

    def reissue_in_place(self, wait: Wait, review: Review) -> None:
        """Reissue the request of a wait that is not the session's only one (a fan-in
        member's next approval stage) in the session's epoch, now: the other waits keep
        theirs. Not once the wait's deadline has passed: it times out with the others
        (``resume``), as a session waiting on it alone would rather than reissue."""
        work = self.work
        tool = self.tool_of(wait)
        current = work.snap.wait_for(wait.correlation_id)
        if tool is None or current is None or review.request is None:
            return
        if current.deadline <= work.now:
            return
        reason = (review.reason or ObservationReason.ESCALATED).value
        new = self.suspender.reopen(
            current, tool, review.request, reason=reason, withdraw=review.withdraw
        )
        self.fan_in.reissued(current, new)
        self._closed = [*self._closed, current]
        self._reopened = True

    async def apply(self, event: InboxEvent, wait: Wait, review: Review | None = None) -> bool:
        """Run the guard, then inject the event (or the answer its tool's review made of
        it) as the tool's answer. False if the guard ended the session."""
        work = self.work
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        current = None
        needed = guard.needs_state(wait)
        # A tool with a ``current_state`` of its own reports the state whether or not it
        # set ``checks_state``: left at its default, the guard passed every answer unasked.
        reports = isinstance(tool, LongRunningTool) and (
            tool.checks_state or type(tool).current_state is not LongRunningTool.current_state
        )
        asked = needed and reports
        if isinstance(tool, LongRunningTool) and asked:
            timeout_s = tool.timeout_s or self.deps.config.tool_timeout.total_seconds()
            try:
                current = await call_out(
                    tool.current_state,
                    wait,
                    tenant=work.snap.tenant,
                    timeout_s=timeout_s,
                    what=f"{tool.spec.name}.current_state",
                )
            except Exception as exc:
                raise GuardUnavailable(f"{type(exc).__name__}: {exc}") from exc
            self.retrier.succeeded()
        verdict = guard.evaluate(
            wait.guard, current, now=work.now, asked=asked, unchecked=needed and not reports
        )
        content: JsonValue = review.answer if review is not None else event.data
        if not verdict.ok:
            work.stats.drifts += 1
            if wait.on_drift is DriftPolicy.BLOCK:
                await self.deps.observer.security_alert(work.snap, wait, verdict.reasons)
                work.update(processed_events=[*work.snap.processed_events, event.key])
                await self.finish(
                    SessionState.FAILED,
                    reason="guard blocked",
                    error=ErrorInfo(code="guard_blocked", message="; ".join(verdict.reasons)),
                )
                return False
            if wait.on_drift is DriftPolicy.COMPENSATE:
                work.update(processed_events=[*work.snap.processed_events, event.key])
                await self.finish(
                    SessionState.FAILED,
                    reason="state drift",
                    compensate=list(work.snap.waits),
                    error=ErrorInfo(
                        code="state_drift",
                        message="; ".join(verdict.reasons),
                        detail={"compensated": True},
                    ),
                )
                return False
            content = {**verdict.notice(wait, current), "event": event.data}
        if wait.group_id is not None and self.fan_in.group_of(wait) is not None:
            # A fan-in member: its answer waits in the group until the condition is met.
            failed = event.kind is EventKind.DISPATCH_FAILED
            closed = self.fan_in.answered(wait, content, failed=failed)
            work.update(processed_events=[*work.snap.processed_events, event.key])
            self._closed = [*self._closed, *closed]
            work.stats.applied += 1
            await self.deps.observer.applied(work.snap, event)
            return True
        work.update(
            messages=[
                *work.snap.messages,
                Message(
                    role="tool",
                    tool_call_id=wait.tool_call_id,
                    content=message_content(content, quote_json_text=quotes_json_text(self.loaded)),
                ),
            ],
            waits=[w for w in work.snap.waits if w.wait_id != wait.wait_id],
            processed_events=[*work.snap.processed_events, event.key],
        )
        self._closed = [*self._closed, wait]
        work.stats.applied += 1
        await self.deps.observer.applied(work.snap, event)
        return True

    async def observe(self, event: InboxEvent, reason: ObservationReason) -> None:
        """Record ``event`` without applying it; it is processed all the same."""
        work = self.work
        record = Observation(
            event_key=event.key, source=event.source, type=event.type, reason=reason, at=work.now
        )
        work.update(
            observations=[*work.snap.observations, record],
            processed_events=[*work.snap.processed_events, event.key],
        )
        work.stats.observed += 1
        await self.deps.observer.observed(work.snap, event, reason.value)

    async def settle_terminal(self) -> None:
        """A finished session still owes its outbox, and still answers late events: they
        are recorded as observations (the caller sees the original outcome)."""
        work = self.work
        events = await self.deps.inbox.pending(
            work.snap.session_id, processed=set(work.snap.processed_events)
        )
        if events:
            for event in events:
                await self.observe(event, ObservationReason.LATE)
            await work.commit()
        await self.suspender.drain_outbox()
