"""One activation of one session: rehydrate, pass the gates, run, checkpoint, sleep.

An ``Activation`` owns a working copy of the snapshot while its runtime holds the
session's lease. Every change reaches storage through ``commit``, a compare-and-swap on
the generation: if anyone else committed meanwhile the activation stops with
``CommitConflict`` and changes nothing. Checkpoints happen at every tool boundary, so a
crash loses at most the step in flight, and the step's idempotency key makes its replay
safe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import JsonValue

from torpor import guard, outbox
from torpor.agent import AgentContext, AgentTurn
from torpor.clock import trunc_ms
from torpor.errors import (
    AgentUnavailable,
    LeaseLost,
    TorporError,
)
from torpor.events import EventKind, InboxEvent
from torpor.gates import Verdict, classify, expired_waits
from torpor.heartbeat import Heartbeat
from torpor.ids import new_correlation_id, new_wait_id, tool_call_key
from torpor.lifecycle import SessionState, transition
from torpor.models import (
    DispatchStatus,
    DriftPolicy,
    ErrorInfo,
    Message,
    Observation,
    ObservationReason,
    OutboxEntry,
    OutboxKind,
    SessionSnapshot,
    ToolCall,
    ToolLogEntry,
    Wait,
)
from torpor.plugins import LoadedAgent
from torpor.ports import (
    TimerKind,
    WaitBinding,
)
from torpor.ports.services import Services
from torpor.tools import LongRunningTool, Tool, ToolContext, WaitPlan

MAX_STEPS_PER_ACTIVATION = 200


@dataclass
class Stats:
    applied: int = 0
    observed: int = 0
    agent_steps: int = 0
    first_step_at: datetime | None = None
    drifts: int = 0


def binding_of(snapshot: SessionSnapshot, wait: Wait) -> WaitBinding:
    return WaitBinding(
        tenant=snapshot.tenant,
        correlation_id=wait.correlation_id,
        session_id=snapshot.session_id,
        epoch=wait.epoch,
        step_id=wait.waiting_step_id,
        deadline=wait.deadline,
    )


def poll_member(session_id: str, correlation_id: str, attempt: int) -> str:
    """The POLL timer entry of a wait: who, which wait, how many polls so far."""
    return f"{session_id}|{correlation_id}|{attempt}"


def error_result(exc: Exception | str, code: str = "tool_error") -> JsonValue:
    """How a failed call is shown to the agent: as data it can branch or re-plan on."""
    if isinstance(exc, Exception):
        code = str(getattr(exc, "code", code))
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = exc
    return {"error": {"code": code, "message": message[:1000]}}


def _content(value: JsonValue) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class Activation:
    def __init__(
        self,
        deps: Services,
        snapshot: SessionSnapshot,
        heartbeat: Heartbeat,
        loaded: LoadedAgent | None,
    ) -> None:
        self.deps = deps
        self.snap = snapshot
        self.heartbeat = heartbeat
        self.loaded = loaded
        self.stats = Stats()
        self._committed_state = snapshot.state
        self._closed: list[Wait] = []  # waits answered by this activation, to unbind

    @property
    def now(self) -> datetime:
        return self.deps.clock.now()

    def state(self) -> SessionState:
        return self.snap.state

    # -- commit -------------------------------------------------------------------------

    async def commit(self) -> None:
        if self.heartbeat.lost:
            raise LeaseLost(f"lease on {self.snap.session_id} was lost; not committing")
        draft = self.snap.model_copy(
            update={
                "lease_fence": self.heartbeat.lease.token,
                "updated_at": self.now,
                "outbox": outbox.trim(self.snap.outbox),
            }
        )
        self.snap = await self.deps.snapshots.save(draft, expected_generation=self.snap.generation)
        if self.snap.state is not self._committed_state:
            previous, self._committed_state = self._committed_state, self.snap.state
            await self.deps.index.record_session(
                tenant=self.snap.tenant,
                session_id=self.snap.session_id,
                state=self.snap.state,
                generation=self.snap.generation,
            )
            await self.deps.observer.transitioned(self.snap, previous)

    def move(self, target: SessionState, reason: str = "") -> None:
        self.snap = transition(self.snap, target, now=self.now, reason=reason)

    def update(self, **fields: Any) -> None:
        self.snap = self.snap.model_copy(update=fields)

    # -- outbox -------------------------------------------------------------------------

    async def drain_outbox(self) -> None:
        """Send every due entry; commit the new statuses once."""
        due = [e for e in self.snap.outbox if outbox.is_due(e, self.now)]
        if not due:
            return
        tools = self.loaded.tools if self.loaded else None
        settled: dict[str, Any] = {}
        failed_starts: list[str] = []
        for entry in due:
            if tools is None:
                break
            result = await outbox.send(
                entry,
                self.snap,
                tools=tools,
                router=self.deps.router,
                notifier=self.deps.notifier,
                now=self.now,
            )
            new = outbox.settle(entry, result, now=self.now)
            settled[entry.entry_id] = new
            if isinstance(result, outbox.RetryAt):
                await self.deps.index.schedule(
                    kind=TimerKind.RETRY, member=self.snap.session_id, at=result.at
                )
            if isinstance(result, outbox.GaveUp) and entry.kind is OutboxKind.START:
                failed_starts.append(entry.correlation_id or "")
        self.update(outbox=[settled.get(e.entry_id, e) for e in self.snap.outbox])
        await self.commit()
        for cid in failed_starts:
            wait = self.snap.wait_for(cid)
            if wait is not None:
                # Nobody will ever answer this wait: answer it ourselves, through the inbox,
                # so the agent sees the failure like any other result.
                await self.deps.inbox.deliver(
                    InboxEvent.answering(
                        wait,
                        kind=EventKind.DISPATCH_FAILED,
                        session_id=self.snap.session_id,
                        source="torpor",
                        event_id=f"dispatch-failed:{cid}",
                        type="torpor.dispatch.failed",
                        received_at=self.now,
                        data={"status": "error", "error": "the request could not be sent"},
                    )
                )

    async def bind_waits(self) -> None:
        """Durable correlation record first, then the index: a callback that races the
        index still finds its session through the record."""
        pending_starts = {
            e.correlation_id
            for e in self.snap.outbox
            if e.kind is OutboxKind.START and e.status is DispatchStatus.PENDING
        }
        grace = timedelta(seconds=self.deps.settings.storage.binding_grace_s)
        for wait in self.snap.waits:
            if wait.correlation_id not in pending_starts:
                continue
            binding = binding_of(self.snap, wait)
            await self.deps.correlations.record(binding, business_key=wait.business_key)
            await self.deps.index.bind_wait(binding, business_key=wait.business_key, grace=grace)
            tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
            if isinstance(tool, LongRunningTool) and tool.can_poll:
                await self.deps.index.schedule(
                    kind=TimerKind.POLL,
                    member=poll_member(self.snap.session_id, wait.correlation_id, 0),
                    at=wait.overdue_after,
                )

    async def unbind(self, waits: list[Wait]) -> None:
        for wait in waits:
            await self.deps.index.unbind(
                tenant=self.snap.tenant,
                correlation_id=wait.correlation_id,
                business_key=wait.business_key,
            )

    # -- ending -------------------------------------------------------------------------

    async def finish(
        self,
        target: SessionState,
        *,
        reason: str,
        result: JsonValue = None,
        error: ErrorInfo | None = None,
        compensate: list[Wait] | None = None,
    ) -> None:
        closing = list(self.snap.waits)
        entries = [
            outbox.compensate_entry(self.snap, w, reason=reason, now=self.now)
            for w in (compensate or [])
            if self._can_compensate(w)
        ]
        self.move(target, reason)
        self.update(waits=[], result=result, error=error, outbox=[*self.snap.outbox, *entries])
        if "terminal" in self.deps.settings.notifications.on and self.snap.callback_url:
            self.update(
                outbox=[
                    *self.snap.outbox,
                    outbox.notify_entry(self.snap, event=target.value, now=self.now),
                ]
            )
        await self.commit()
        await self.unbind(closing)
        await self.drain_outbox()

    def notifications(self, event: str) -> list[OutboxEntry]:
        """NOTIFY entries for a non-terminal event the deployment notifies on."""
        if event not in self.deps.settings.notifications.on or not self.snap.callback_url:
            return []
        return [outbox.notify_entry(self.snap, event=event, now=self.now)]

    def _can_compensate(self, wait: Wait) -> bool:
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        return isinstance(tool, LongRunningTool) and tool.can_compensate

    async def settle_terminal(self) -> None:
        """A finished session still owes its outbox, and still answers late events: they
        are recorded as observations (the caller sees the original outcome)."""
        events = await self.deps.inbox.pending(
            self.snap.session_id, processed=set(self.snap.processed_events)
        )
        if events:
            for event in events:
                await self.observe(event, ObservationReason.LATE)
            await self.commit()
        await self.drain_outbox()

    async def observe(self, event: InboxEvent, reason: ObservationReason) -> None:
        record = Observation(
            event_key=event.key, source=event.source, type=event.type, reason=reason, at=self.now
        )
        self.update(
            observations=[*self.snap.observations, record],
            processed_events=[*self.snap.processed_events, event.key],
        )
        self.stats.observed += 1
        await self.deps.observer.observed(self.snap, event, reason.value)

    # -- waking up ----------------------------------------------------------------------

    async def resume(self) -> None:
        """Apply what the inbox holds to the waits, through the gates, in order."""
        events = await self.deps.inbox.pending(
            self.snap.session_id, processed=set(self.snap.processed_events)
        )
        now = self.now
        cancel = next((e for e in events if e.kind is EventKind.CANCEL), None)
        if cancel is not None:
            self.update(processed_events=[*self.snap.processed_events, cancel.key])
            await self.finish(
                SessionState.CANCELLED,
                reason="cancelled",
                compensate=list(self.snap.waits),
                error=None,
                result=None,
            )
            return
        overdue = expired_waits(self.snap, now=now)
        if not events and not overdue:
            return
        if self.snap.state is SessionState.SUSPENDED:
            self.move(SessionState.RESUMING, "events" if events else "deadline")
        for event in events:
            decision = classify(self.snap, event, processed=set(self.snap.processed_events))
            if decision.verdict is Verdict.OBSERVE:
                await self.observe(event, decision.reason or ObservationReason.STALE)
                continue
            assert decision.wait is not None
            if decision.verdict is Verdict.EXPIRED:
                await self.observe(event, ObservationReason.LATE)
                overdue.append(decision.wait)
                continue
            if not await self.apply(event, decision.wait):
                return  # the guard ended the session
        still_open = [w for w in overdue if self.snap.wait_for(w.correlation_id)]
        if still_open:
            await self.finish(
                SessionState.TIMED_OUT,
                reason="deadline passed",
                compensate=list(self.snap.waits),
                error=ErrorInfo(
                    code="sla_expired",
                    message="no answer before the deadline",
                    detail={"waits": [w.wait_id for w in still_open]},
                ),
            )
            return
        if self.snap.state is not SessionState.RESUMING:
            return
        if self.snap.waits:
            self.move(SessionState.SUSPENDED)
        else:
            self.move(SessionState.RUNNING)
            self.update(outbox=[*self.snap.outbox, *self.notifications("resumed")])
        await self.commit()
        await self.unbind(self._closed)
        self._closed = []

    async def apply(self, event: InboxEvent, wait: Wait) -> bool:
        """Run the guard, then inject the event as the tool's answer. False if the guard
        ended the session."""
        tool = self.loaded.tools.get(wait.tool_name) if self.loaded else None
        current = None
        if isinstance(tool, LongRunningTool) and tool.checks_state and guard.needs_state(wait):
            current = await tool.current_state(wait, tenant=self.snap.tenant)
        verdict = guard.evaluate(wait.guard, current, now=self.now)
        content: JsonValue = event.data
        if not verdict.ok:
            self.stats.drifts += 1
            if wait.on_drift is DriftPolicy.BLOCK:
                await self.deps.observer.security_alert(self.snap, wait, verdict.reasons)
                self.update(processed_events=[*self.snap.processed_events, event.key])
                await self.finish(
                    SessionState.FAILED,
                    reason="guard blocked",
                    error=ErrorInfo(code="guard_blocked", message="; ".join(verdict.reasons)),
                )
                return False
            if wait.on_drift is DriftPolicy.COMPENSATE:
                self.update(processed_events=[*self.snap.processed_events, event.key])
                await self.finish(
                    SessionState.FAILED,
                    reason="state drift",
                    compensate=list(self.snap.waits),
                    error=ErrorInfo(
                        code="state_drift",
                        message="; ".join(verdict.reasons),
                        detail={"compensated": True},
                    ),
                )
                return False
            content = {**verdict.notice(wait, current), "event": event.data}
        self.update(
            messages=[
                *self.snap.messages,
                Message(role="tool", tool_call_id=wait.tool_call_id, content=_content(content)),
            ],
            waits=[w for w in self.snap.waits if w.wait_id != wait.wait_id],
            processed_events=[*self.snap.processed_events, event.key],
        )
        self._closed = [*self._closed, wait]
        self.stats.applied += 1
        await self.deps.observer.applied(self.snap, event)
        return True

    # -- running ------------------------------------------------------------------------

    def unanswered_calls(self) -> list[ToolCall]:
        for i in range(len(self.snap.messages) - 1, -1, -1):
            message = self.snap.messages[i]
            if message.role == "assistant":
                answered = {m.tool_call_id for m in self.snap.messages[i + 1 :] if m.role == "tool"}
                return [c for c in message.tool_calls or [] if c.id not in answered]
        return []

    def agent_context(self) -> AgentContext:
        assert self.loaded is not None
        return AgentContext(
            session_id=self.snap.session_id,
            tenant=self.snap.tenant,
            step=self.snap.step,
            input=self.snap.input,
            metadata=dict(self.snap.metadata),
            tools=self.loaded.tools.specs(),
            variables=json.loads(json.dumps(self.snap.variables)),
        )

    def tool_context(self, call: ToolCall, key: str) -> ToolContext:
        return ToolContext(
            session_id=self.snap.session_id,
            tenant=self.snap.tenant,
            step=self.snap.step,
            tool_call_id=call.id,
            idempotency_key=key,
            trace_id=self.snap.trace_id,
            now=self.now,
            fence=self.heartbeat.lease.token,
            variables=dict(self.snap.variables),
        )

    async def run(self) -> None:
        """Drive the agent loop until the session suspends or ends."""
        assert self.loaded is not None
        for _ in range(MAX_STEPS_PER_ACTIVATION):
            if self.snap.state is not SessionState.RUNNING:
                return
            calls = self.unanswered_calls()
            if calls:
                await self.run_calls(calls)
                continue
            if await self.cancel_requested():
                return
            await self.agent_step()
        # A runaway agent: checkpointed; let the reconciler pick it up again later.
        await self.deps.index.schedule(
            kind=TimerKind.RETRY, member=self.snap.session_id, at=self.now
        )

    async def cancel_requested(self) -> bool:
        events = await self.deps.inbox.pending(
            self.snap.session_id, processed=set(self.snap.processed_events)
        )
        cancel = next((e for e in events if e.kind is EventKind.CANCEL), None)
        if cancel is None:
            return False
        self.update(processed_events=[*self.snap.processed_events, cancel.key])
        await self.finish(SessionState.CANCELLED, reason="cancelled")
        return True

    async def agent_step(self) -> None:
        assert self.loaded is not None
        if self.stats.first_step_at is None:
            self.stats.first_step_at = self.now
        await self.deps.observer.agent_step(self.snap)
        ctx = self.agent_context()
        try:
            turn: AgentTurn = await self.loaded.agent.step(list(self.snap.messages), ctx)
        except AgentUnavailable as exc:
            await self.retry_later(exc)
            return
        except TorporError as exc:
            await self.fail(exc.code, str(exc))
            return
        except Exception as exc:  # the agent's own bug: fail the session, keep the process
            await self.fail("agent_crashed", f"{type(exc).__name__}: {exc}")
            return
        self.stats.agent_steps += 1
        self.update(
            step=self.snap.step + 1,
            variables=ctx.variables,
            messages=[*self.snap.messages, turn.message],
        )
        if turn.final:
            result = turn.result if turn.result is not None else turn.message.content
            await self.finish(SessionState.COMPLETED, reason="agent finished", result=result)
        else:
            await self.commit()

    async def retry_later(self, exc: TorporError) -> None:
        quota = self.snap.retry
        if quota.exhausted:
            await self.fail(exc.code, f"gave up after {quota.used} retries: {exc}")
            return
        self.update(retry=quota.model_copy(update={"used": quota.used + 1}))
        await self.commit()
        delay = 2.0 * (2**quota.used)
        await self.deps.index.schedule(
            kind=TimerKind.RETRY,
            member=self.snap.session_id,
            at=self.now + timedelta(seconds=delay),
        )
        # The session stays RUNNING; this activation ends and the timer brings it back.
        raise StopActivation("retry scheduled")

    async def fail(self, code: str, message: str) -> None:
        await self.finish(
            SessionState.FAILED, reason=code, error=ErrorInfo(code=code, message=message[:2000])
        )

    async def run_calls(self, calls: list[ToolCall]) -> None:
        assert self.loaded is not None
        plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]] = []
        for call in calls:
            tool = self.loaded.tools.get(call.function.name)
            if isinstance(tool, LongRunningTool):
                planned = await self.plan_wait(call, tool)
                if planned is not None:
                    plans.append((call, tool, planned))
                continue
            result = await self.run_sync(call, tool)
            self.update(
                messages=[
                    *self.snap.messages,
                    Message(role="tool", tool_call_id=call.id, content=_content(result)),
                ]
            )
            await self.commit()  # checkpoint at every tool boundary
        if plans:
            await self.suspend(plans)

    async def run_sync(self, call: ToolCall, tool: Tool | None) -> JsonValue:
        key = tool_call_key(self.snap.session_id, self.snap.step, call.id)
        logged = self.snap.tool_log.get(key)
        if logged is not None:
            return logged.result  # replay after a crash: never run a completed call twice
        if tool is None:
            return {"error": {"code": "unknown_tool", "message": f"no tool {call.function.name!r}"}}
        result: JsonValue
        try:
            args = json.loads(call.function.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as exc:
            result = {"error": {"code": "bad_arguments", "message": str(exc)}}
        else:
            try:
                result = await tool.run(args, self.tool_context(call, key))
            except Exception as exc:  # the tool's failure is the agent's information
                result = error_result(exc)
        entry = ToolLogEntry(
            key=key,
            tool_name=call.function.name,
            tool_call_id=call.id,
            step=self.snap.step,
            result=result,
            completed_at=self.now,
        )
        self.update(tool_log={**self.snap.tool_log, key: entry})
        return result

    async def plan_wait(self, call: ToolCall, tool: LongRunningTool) -> WaitPlan | None:
        key = tool_call_key(self.snap.session_id, self.snap.step, call.id)
        try:
            args = json.loads(call.function.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            return await tool.begin(args, self.tool_context(call, key))
        except Exception as exc:
            error = error_result(exc)
            self.update(
                messages=[
                    *self.snap.messages,
                    Message(role="tool", tool_call_id=call.id, content=_content(error)),
                ]
            )
            await self.commit()
            return None

    async def suspend(self, plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]]) -> None:
        """One commit: SUSPENDED + the waits + their outbox entries. Then bind, then send."""
        now = self.now
        epoch = self.snap.epoch + 1  # RUNNING → SUSPENDED opens a wait: the epoch moves on
        waits = [
            Wait(
                wait_id=new_wait_id(),
                correlation_id=new_correlation_id(),
                business_key=plan.business_key,
                waiting_step_id=str(self.snap.step),
                epoch=epoch,
                action_key=plan.action_key,
                tool_name=tool.spec.name,
                tool_call_id=call.id,
                expected_types=plan.expected_types,
                allowed_sources=plan.allowed_sources,
                opened_at=now,
                deadline=trunc_ms(now + timedelta(seconds=plan.sla_s)),
                expected_duration_s=plan.expected_duration_s,
                guard=plan.guard,
                on_drift=plan.on_drift,
                request=plan.request,
            )
            for call, tool, plan in plans
        ]
        self.move(SessionState.SUSPENDED, "waiting for " + ", ".join(w.tool_name for w in waits))
        assert self.snap.epoch == epoch
        entries = [outbox.start_entry(self.snap, w, now=now) for w in waits]
        entries += self.notifications("suspended")
        self.update(waits=waits, outbox=[*self.snap.outbox, *entries])
        await self.commit()
        await self.complete_suspend()

    async def complete_suspend(self) -> None:
        await self.bind_waits()
        await self.drain_outbox()


class StopActivation(BaseException):
    """Ends an activation early after a checkpoint (e.g. a retry was scheduled).

    A BaseException on purpose: an agent's or tool's ``except Exception`` must not swallow
    it on its way out."""
