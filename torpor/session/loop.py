"""The agent loop: agent steps and sync tool calls, each one checkpointed.

A sync tool runs inline (a plain ``def`` in a worker thread), under a deadline, and its
result goes into the completed-call log under ``H(session:step:call)``, so a replay after
a crash never runs it twice. A call that times out is not logged: its outcome is unknown,
so it is retried with backoff under the same key. A long-running
tool plans a wait instead; once every call of the turn is handled, the planned waits
suspend the session (``torpor.session.suspend``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from torpor import tracing
from torpor.agent import AgentContext, AgentTurn
from torpor.deadlines import call_out
from torpor.errors import AgentUnavailable, CallTimedOut, LeaseLost, TorporError
from torpor.faults import CrashPoint, crash_point
from torpor.ids import tool_call_key
from torpor.lifecycle import SessionState
from torpor.models import ErrorInfo, Message, ToolCall, ToolLogEntry
from torpor.plugins import LoadedAgent
from torpor.ports import TimerKind
from torpor.session.retry import Retrier
from torpor.session.suspend import Suspender
from torpor.session.working import WorkingCopy, error_result, message_content, quotes_json_text
from torpor.tools import LongRunningTool, Tool, ToolContext, WaitPlan
from torpor.transient import transient

MAX_STEPS_PER_ACTIVATION = 200
# How long a read of the inbox stands for the agent loop's look for a cancel before it
# runs the calls a turn chose (``AgentLoop.run``).
INBOX_FRESH_S = 0.05


def tool_arguments(raw: str | None) -> dict[str, Any]:
    """A call's arguments: a JSON object, else ``ValueError`` (the model's to correct, as
    a tool error). A document nested too deeply for the parser is one: its
    RecursionError escaped the activation, which then failed again on every replay of
    the same committed turn, the session RUNNING for good. So is one holding an escaped
    lone surrogate (``"\\ud83d"``): a tool that echoed it made a result no snapshot could
    encode, and every replay ran the tool again and failed at the same commit."""
    try:
        args = json.loads(raw or "{}")
    except RecursionError:
        raise ValueError("arguments are nested too deeply") from None
    if not isinstance(args, dict):
        raise ValueError("arguments must be a JSON object")
    try:
        json.dumps(args, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("arguments hold a lone UTF-16 surrogate") from None
    return args


@dataclass(frozen=True)
class _Ahead:
    """An agent step called before it was due: on what, and its call."""

    step: int
    messages: int
    ctx: AgentContext
    turn: asyncio.Future[AgentTurn]


class AgentLoop:
    """The running phase of one activation."""

    def __init__(self, work: WorkingCopy, loaded: LoadedAgent | None, suspender: Suspender) -> None:
        self.work = work
        self.deps = work.deps
        self.loaded = loaded
        self.suspender = suspender
        self.retrier = Retrier(work)
        self._ahead: _Ahead | None = None

    def step_ahead(self) -> None:
        """Call the agent's next step now, on the messages the wake has just built, while
        the wake's commit is still being written: the step's input is durable already
        (the snapshot it was loaded from and the inbox), and the commit costs as long as
        a fast step. Only the call runs early. Its turn is taken in ``agent_step``, after
        that commit, and only if the session is still at the same step with the same
        messages; otherwise (a cancel, a failed commit) it is cancelled. An agent step
        was always replayed after a crash before its own commit, so a call whose turn is
        not taken is nothing new for an agent."""
        if self.loaded is None or self._ahead is not None or self.unanswered_calls():
            return
        snap = self.work.snap
        ctx = self.agent_context()
        turn = asyncio.ensure_future(self._call_agent(list(snap.messages), ctx))
        self._ahead = _Ahead(snap.step, len(snap.messages), ctx, turn)

    def drop_ahead(self) -> None:
        """Cancel a step called ahead whose turn will not be taken."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.turn.cancel()
            # Its outcome is nobody's: retrieved here so it is not reported as lost.
            ahead.turn.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def run(self) -> None:
        """Drive the agent loop until the session suspends or ends."""
        assert self.loaded is not None
        for _ in range(MAX_STEPS_PER_ACTIVATION):
            if self.work.snap.state is not SessionState.RUNNING:
                return
            calls = self.unanswered_calls()
            # Before the calls too, once a while has passed since the inbox was read: a
            # cancel that came while the agent chose them (an LLM step takes seconds)
            # stops them, where they ran, and a long-running one sent its request, before
            # the cancel was seen. Not after a step of a few milliseconds: a listing of
            # the inbox was 10-20 % of a resume's CPU (a cancel within that window is
            # seen by the next activation, as one after the last read always was).
            stale = time.monotonic() - self.work.inbox_read_at >= INBOX_FRESH_S
            if (not calls or stale) and await self.cancel_requested():
                return
            if calls:
                await self.run_calls(calls)
                continue
            await self.agent_step()
        # A runaway agent: checkpointed; let the reconciler pick it up again later.
        await self.deps.index.schedule(
            kind=TimerKind.RETRY, member=self.work.snap.session_id, at=self.work.now
        )

    async def cancel_requested(self) -> bool:
        work = self.work
        cancel = await work.pending_cancel()
        if cancel is None:
            return False
        work.update(processed_events=[*work.snap.processed_events, cancel.key])
        await self.suspender.finish(SessionState.CANCELLED, reason="cancelled")
        return True

    # -- agent steps --------------------------------------------------------------------

    async def agent_step(self) -> None:
        assert self.loaded is not None
        work = self.work
        limit = self.loaded.config.max_steps
        if work.snap.step >= limit:
            # Each activation stops at MAX_STEPS_PER_ACTIVATION and is retried at once, so
            # an agent that never finishes (a model calling tools in a loop) ran, and was
            # billed for a history resent whole at every step, for ever.
            self.drop_ahead()
            await self.fail(
                "step_limit",
                f"the agent took {limit} steps without finishing"
                f" (agents.{self.loaded.name}.max_steps)",
            )
            return
        if work.stats.first_step_at is None:
            work.stats.first_step_at = work.now
        await self.deps.observer.agent_step(work.snap)
        ahead, self._ahead = self._ahead, None
        call: Awaitable[AgentTurn]
        if ahead is not None and (ahead.step, ahead.messages) == (
            work.snap.step,
            len(work.snap.messages),
        ):
            ctx, call = ahead.ctx, ahead.turn
        else:
            if ahead is not None:  # called on what the session no longer is
                self._ahead = ahead
                self.drop_ahead()
            ctx = self.agent_context()
            call = self._call_agent(list(work.snap.messages), ctx)
        try:
            turn = await call
        except (AgentUnavailable, CallTimedOut) as exc:
            await self.retry_later(exc)
            return
        except TorporError as exc:
            # Its own ``retryable`` decides, as everywhere: a busy resolver (an OSError
            # too) or a store that did not answer failed the session for good.
            if exc.retryable:
                await self.retry_later(exc)
            else:
                await self.fail(exc.code, str(exc))
            return
        except Exception as exc:
            if transient(exc):
                # The agent's backend was out of reach (its client's error let out, not
                # turned into AgentUnavailable): retried with backoff, as that would be.
                await self.retry_later(AgentUnavailable(f"{type(exc).__name__}: {exc}"))
                return
            # The agent's own bug: fail the session, keep the process.
            await self.fail("agent_crashed", f"{type(exc).__name__}: {exc}")
            return
        work.stats.agent_steps += 1
        self.retrier.succeeded()
        work.update(
            step=work.snap.step + 1,
            variables=ctx.variables,
            messages=[*work.snap.messages, turn.message],
        )
        if turn.final:
            result = turn.result if turn.result is not None else turn.message.content
            await self.suspender.finish(
                SessionState.COMPLETED, reason="agent finished", result=result
            )
        else:
            await work.commit()

    async def _call_agent(self, messages: list[Message], ctx: AgentContext) -> AgentTurn:
        assert self.loaded is not None
        session_id = self.work.snap.session_id
        timeout_s = self.deps.config.agent_step_timeout.total_seconds()
        # Set here, as the call starts, not when ``ctx`` was built: a step called ahead
        # may be built a while before it runs.
        ctx.deadline = time.monotonic() + timeout_s
        with tracing.span(
            "torpor.agent.step", **{"torpor.session_id": session_id, "torpor.step": ctx.step}
        ):
            turn: AgentTurn = await call_out(
                self.loaded.agent.step,
                messages,
                ctx,
                timeout_s=timeout_s,
                what="agent.step",
            )
        return turn

    async def retry_later(self, exc: TorporError) -> None:
        """Back off and retry (``torpor.session.retry``); quarantine once the quota is spent."""
        await self.retrier.later(exc.code, str(exc))

    async def fail(self, code: str, message: str) -> None:
        await self.suspender.finish(
            SessionState.FAILED, reason=code, error=ErrorInfo(code=code, message=message[:2000])
        )

    # -- tool calls ---------------------------------------------------------------------

    def unanswered_calls(self) -> list[ToolCall]:
        """The calls of the last assistant turn that have no tool message yet."""
        messages = self.work.snap.messages
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            if message.role == "assistant":
                answered = {m.tool_call_id for m in messages[i + 1 :] if m.role == "tool"}
                return [c for c in message.tool_calls or [] if c.id not in answered]
        return []

    async def run_calls(self, calls: list[ToolCall]) -> None:
        assert self.loaded is not None
        work = self.work
        plans: list[tuple[ToolCall, LongRunningTool, WaitPlan]] = []
        for call in calls:
            tool = self.loaded.tools.get(call.function.name)
            if isinstance(tool, LongRunningTool):
                planned = await self.plan_wait(call, tool)
                if planned is not None:
                    plans.append((call, tool, planned))
                continue
            result = await self.run_sync(call, tool)
            crash_point(CrashPoint.SYNC_TOOL_RAN)
            work.update(
                messages=[
                    *work.snap.messages,
                    Message(
                        role="tool",
                        tool_call_id=call.id,
                        content=message_content(
                            result, quote_json_text=quotes_json_text(self.loaded)
                        ),
                    ),
                ]
            )
            await work.commit()  # checkpoint at every tool boundary
        if plans:
            await self.suspender.suspend(plans)

    async def run_sync(self, call: ToolCall, tool: Tool | None) -> JsonValue:
        work = self.work
        key = tool_call_key(work.snap.session_id, work.snap.step, call.id)
        logged = work.snap.tool_log.get(key)
        if logged is not None:
            return logged.result  # replay after a crash: never run a completed call twice
        if tool is None:
            return {"error": {"code": "unknown_tool", "message": f"no tool {call.function.name!r}"}}
        if work.heartbeat.lapsed():
            # The lease may be another holder's by now (the index was out of reach for a
            # whole TTL): that holder runs this call from the last checkpoint, and running
            # it here too would call the tool twice.
            raise LeaseLost(f"lease on {work.snap.session_id} lapsed; not calling {key}")
        result: JsonValue
        try:
            args = tool_arguments(call.function.arguments)
        except ValueError as exc:
            result = {"error": {"code": "bad_arguments", "message": str(exc)}}
        else:
            try:
                with tracing.span("torpor.tool.call", **{"torpor.tool": call.function.name}):
                    result = await call_out(
                        tool.run,
                        args,
                        self.tool_context(call, key),
                        timeout_s=self.timeout_s(tool),
                        what=call.function.name,
                        key=key,
                    )
            except CallTimedOut as exc:
                if not self.retrier.exhausted:
                    # Its outcome is unknown: not logged, so the retry runs it again under
                    # the same key (joining it if it is still running in this process).
                    await self.retrier.later(exc.code, str(exc))
                result = error_result(exc)  # retries spent: the agent decides
            except Exception as exc:  # the tool's failure is the agent's information
                result = error_result(exc)
            else:
                self.retrier.succeeded()
                # A result no snapshot can hold (a lone surrogate, as text read with
                # surrogateescape carries; an object JSON has no form for) made the commit
                # raise, and every replay ran the tool again into the same commit.
                try:
                    json.dumps(result, ensure_ascii=False).encode()
                except (TypeError, ValueError) as exc:
                    result = error_result(f"the tool's result cannot be stored: {exc}")
        entry = ToolLogEntry(
            key=key,
            tool_name=call.function.name,
            tool_call_id=call.id,
            step=work.snap.step,
            result=result,
            completed_at=work.now,
        )
        work.update(tool_log={**work.snap.tool_log, key: entry})
        return result

    async def plan_wait(self, call: ToolCall, tool: LongRunningTool) -> WaitPlan | None:
        work = self.work
        key = tool_call_key(work.snap.session_id, work.snap.step, call.id)
        try:
            args = tool_arguments(call.function.arguments)
            with tracing.span("torpor.tool.begin", **{"torpor.tool": call.function.name}):
                plan: WaitPlan = await call_out(
                    tool.begin,
                    args,
                    self.tool_context(call, key),
                    timeout_s=self.timeout_s(tool),
                    what=f"{call.function.name}.begin",
                )
            return plan
        except Exception as exc:
            error = error_result(exc)
            work.update(
                messages=[
                    *work.snap.messages,
                    Message(role="tool", tool_call_id=call.id, content=message_content(error)),
                ]
            )
            await work.commit()
            return None

    def timeout_s(self, tool: Tool | LongRunningTool) -> float:
        return tool.timeout_s or self.deps.config.tool_timeout.total_seconds()

    # -- contexts -----------------------------------------------------------------------

    def agent_context(self) -> AgentContext:
        assert self.loaded is not None
        snap = self.work.snap
        return AgentContext(
            session_id=snap.session_id,
            tenant=snap.tenant,
            step=snap.step,
            input=snap.input,
            metadata=dict(snap.metadata),
            tools=self.loaded.tools.specs(),
            variables=json.loads(json.dumps(snap.variables)),
        )

    def tool_context(self, call: ToolCall, key: str) -> ToolContext:
        snap = self.work.snap
        return ToolContext(
            session_id=snap.session_id,
            tenant=snap.tenant,
            step=snap.step,
            tool_call_id=call.id,
            idempotency_key=key,
            trace_id=snap.trace_id,
            now=self.work.now,
            fence=self.work.heartbeat.lease.token,
            variables=dict(snap.variables),
        )
