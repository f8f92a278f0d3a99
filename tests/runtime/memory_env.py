"""A torpor deployment in one process on the in-memory adapters, with probe tools.

The tools here are plain classes the plugin resolver imports by path; they report what
happened through ``Probe`` (a process-wide record the test resets), so a test can count
calls, block one on a real ``threading.Event``, or make one hang or fail.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic import JsonValue

from actors.wiring import open_services, session_runtime
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.clock import ManualClock
from torpor.errors import ToolError
from torpor.models import GuardBaseline, Message, SessionSnapshot
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.session import SessionRuntime
from torpor.settings import Settings
from torpor.tools import (
    DispatchRequest,
    ExternalState,
    LongRunningTool,
    Tool,
    ToolContext,
    ToolSpec,
    WaitPlan,
    sync_tool,
)


@dataclass
class Probe:
    """What the probe tools did, and how the test wants them to behave."""

    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool, idempotency key)
    session_ids: list[str] = field(default_factory=list)  # who called ``block``
    running: int = 0
    max_running: int = 0
    hang: bool = False  # async tools: never return (until cancelled)
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    state_fails: bool = False  # current_state raises
    state_gone: bool = False  # current_state finds nothing (the entity was deleted)
    dispatched: list[DispatchRequest] = field(default_factory=list)
    agent_hangs: bool = False
    # Each agent step: the deadline its context carried, and ``time.monotonic()`` then.
    agent_deadlines: list[tuple[float | None, float]] = field(default_factory=list)


PROBE = Probe()


def reset() -> Probe:
    global PROBE
    PROBE.release.set()  # let a thread left over from an earlier test finish
    PROBE = Probe()
    return PROBE


def _block(args: dict[str, Any], ctx: ToolContext) -> JsonValue:
    """Blocks its thread until the test releases it (or ``hold_s`` pass)."""
    probe = PROBE
    probe.calls.append(("block", ctx.idempotency_key))
    probe.session_ids.append(ctx.session_id)
    probe.running += 1
    probe.max_running = max(probe.max_running, probe.running)
    probe.started.set()
    try:
        released = probe.release.wait(timeout=float(args.get("hold_s", 5.0)))
    finally:
        probe.running -= 1
    return {"released": released}


# A plain ``def`` tool, as ``@sync_tool`` makes one: it must run off the event loop.
block = sync_tool("block")(_block)
block.timeout_s = 10.0


class HangingTool(Tool):
    """An async tool that hangs while the probe says so."""

    spec = ToolSpec(name="hang")

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    async def run(self, args: dict[str, Any], ctx: ToolContext) -> JsonValue:
        PROBE.calls.append(("hang", ctx.idempotency_key))
        if PROBE.hang:
            await asyncio.Event().wait()
        return {"ok": True}


class Approve(LongRunningTool):
    """A long-running tool with a guard; its ``current_state`` can be made to fail."""

    spec = ToolSpec(name="approve")
    answered_by = ("oa",)
    checks_state = True

    def __init__(self, timeout_s: float | None = None, sla_s: float = 3600) -> None:
        self.timeout_s = timeout_s
        self.sla_s = sla_s

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        doc = args.get("doc")
        return WaitPlan(
            action_key=f"approve:{doc}",
            request={"doc": doc},
            business_key=str(doc),
            sla_s=self.sla_s,
            guard=GuardBaseline(version_tag="v1", captured_at=ctx.now),
        )

    async def dispatch(self, request: DispatchRequest) -> None:
        PROBE.dispatched.append(request)

    async def current_state(self, wait: Any, *, tenant: str) -> ExternalState | None:
        PROBE.calls.append(("current_state", wait.correlation_id))
        if PROBE.state_fails:
            raise ToolError("the ERP is down", retryable=True)
        if PROBE.state_gone:
            return None
        return ExternalState(version_tag="v1")


class UnflaggedApprove(Approve):
    """``Approve`` with its ``current_state`` but ``checks_state`` left at its default."""

    checks_state = False


class BlindApprove(Approve):
    """``Approve``'s baseline (a version tag) from a tool that cannot report the state."""

    checks_state = False
    current_state = LongRunningTool.current_state


class RecordingApproval(Approve):
    """The demo's ``request_approval`` as its plan calls it, recording what it is asked."""

    spec = ToolSpec(name="request_approval")

    async def begin(self, args: dict[str, Any], ctx: ToolContext) -> WaitPlan:
        PROBE.calls.append(("request_approval", json.dumps(args, sort_keys=True)))
        doc_id = args.get("doc_id")
        return WaitPlan(action_key=f"approve:{doc_id}", request=dict(args), business_key=doc_id)


class SlowAgent:
    """Finishes at once, unless the probe tells it to hang in ``step``."""

    name = "slow"
    version = "1"

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        PROBE.agent_deadlines.append((ctx.deadline, time.monotonic()))
        if PROBE.agent_hangs:
            await asyncio.Event().wait()
        return AgentTurn(Message(role="assistant", content="done"), result="done")


def plan_agent(plan: dict[str, Any], tools: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "factory": "torpor.agents.plan:PlanAgent",
        "options": {"plan": plan, "name": "plan", "version": "1"},
        "tools": list(tools),
        "tool_options": {path: options for path, options in tools.items() if options},
    }


@dataclass
class MemEnv:
    services: Services
    control: SessionService
    runtime: SessionRuntime
    clock: ManualClock

    async def load(self, session_id: str) -> SessionSnapshot:
        return await self.services.snapshots.load(session_id)

    async def submit(self, agent: str, input: JsonValue = None) -> str:
        return (await self.control.submit(tenant="acme", agent=agent, input=input)).session_id


@asynccontextmanager
async def memory_env(agents: dict[str, Any], **runtime: Any) -> AsyncIterator[MemEnv]:
    """``runtime``: overrides of the ``[runtime]`` settings (deadlines, retries)."""
    settings = Settings.build(
        {
            "storage": {"object_store_url": "memory://", "index_url": "memory://"},
            "agents": agents,
            "lease": {"heartbeat_s": 0.02, "ttl_s": 30.0},
            "runtime": runtime,
        }
    )
    clock = ManualClock()
    services = open_services(settings, clock=clock)
    runtime = session_runtime(services, "test-runtime")
    control = SessionService(services, InlineActivator(runtime))
    try:
        yield MemEnv(services, control, runtime, clock)
    finally:
        reset()
        await services.close()
