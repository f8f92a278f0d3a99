"""Deadlines and backoff in the session core, on the in-memory adapters.

Every call out is bounded (tools, the agent step, the guard's ``current_state``), a plain
``def`` tool runs off the event loop, one activation has a wall-time cap, and every retry
backs off on one capped exponential schedule. Each test bounds itself with ``asyncio``
deadlines: on code without the bound it fails instead of hanging.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from tests.conftest import eventually as shared_eventually
from tests.runtime import memory_env
from tests.runtime.memory_env import MemEnv, plan_agent, reset
from tests.runtime.memory_env import memory_env as open_env
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.ports import Reason, TimerKind
from torpor.session import ActivationOutcome
from torpor.session.runtime import lease_name

S = SessionState
LIMIT_S = 10.0  # what a test may take before it counts as hung

BLOCK_PLAN = {
    "steps": [
        {"id": "b", "calls": [{"tool": "block", "args": {"hold_s": 5.0}}]},
        {"id": "done", "finish": "${results.b}"},
    ]
}
HANG_PLAN = {
    "steps": [
        {"id": "h", "calls": [{"tool": "hang"}]},
        {"id": "done", "finish": "${results.h}"},
    ]
}
APPROVE_PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
BLOCK = {"tests.runtime.memory_env:block": {}}
SLOW_AGENT = {"factory": "tests.runtime.memory_env:SlowAgent", "max_tool_retries": 2}


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """The shared helper with this module's bound (5 s) and a fast poll."""
    await shared_eventually(check, timeout_s=5.0, interval_s=0.005)


async def retry_due(env: MemEnv, sid: str, at: datetime) -> bool:
    return sid in await env.services.index.due(kind=TimerKind.RETRY, now=at, limit=100)


async def retry_window(env: MemEnv, sid: str, low_s: float, high_s: float) -> None:
    """The session's RETRY timer is due between ``low_s`` and ``high_s`` from now."""
    now = env.clock.now()
    assert not await retry_due(env, sid, now + timedelta(seconds=low_s))
    assert await retry_due(env, sid, now + timedelta(seconds=high_s))


async def test_a_blocking_def_tool_does_not_stop_the_heartbeat() -> None:
    async with open_env({"p": plan_agent(BLOCK_PLAN, BLOCK)}) as env:
        probe = reset()
        index, ttl = env.services.index, env.services.config.lease_ttl
        start = env.clock.now()
        submitted = asyncio.create_task(env.submit("p"))
        await eventually(lambda: asyncio.sleep(0, probe.started.is_set()))
        env.clock.advance(10)

        name = lease_name(probe.session_ids[0])

        async def renewed_meanwhile() -> bool:
            # Alive past the first expiry, and expiring on the renewal made after 10 s.
            first = await index.expired_leases(now=start + ttl + timedelta(seconds=1), limit=9)
            later = start + timedelta(seconds=10) + ttl + timedelta(seconds=1)
            return name not in first and name in await index.expired_leases(now=later, limit=9)

        # The tool is still blocked in its thread while the renewal happens.
        await eventually(renewed_meanwhile)
        assert probe.running == 1
        probe.release.set()
        sid = await asyncio.wait_for(submitted, LIMIT_S)
        snap = await env.load(sid)
        assert snap.state is S.COMPLETED
        assert snap.result == {"released": True}, "the test released it, not its own timeout"


async def test_a_timed_out_def_tool_is_retried_under_its_key_never_twice_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory_env.block, "timeout_s", 0.1)
    async with open_env({"p": plan_agent(BLOCK_PLAN, BLOCK)}) as env:
        probe = reset()
        sid = await asyncio.wait_for(env.submit("p"), LIMIT_S)
        snap = await env.load(sid)
        # Outcome unknown: not logged, not shown to the agent; a retry is scheduled.
        assert snap.state is S.RUNNING and snap.tool_log == {} and snap.retry.used == 1
        await retry_window(env, sid, 1.5, 2.5)  # base 2 s ± 20 % jitter
        # Retried while the first thread still runs: joined, not started a second time.
        result = await asyncio.wait_for(env.runtime.activate(sid, reason=Reason.RETRY), LIMIT_S)
        assert result.outcome is ActivationOutcome.STOPPED
        assert len(probe.calls) == 1 and probe.running == 1
        assert (await env.load(sid)).retry.used == 2
        await retry_window(env, sid, 3.1, 4.9)  # the next step of the same backoff
        probe.release.set()
        await eventually(lambda: asyncio.sleep(0, probe.running == 0))
        await asyncio.wait_for(env.runtime.activate(sid, reason=Reason.RETRY), LIMIT_S)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.retry.used == 0
        keys = {key for _, key in probe.calls}
        assert len(keys) == 1 and probe.max_running == 1
        assert list(done.tool_log) == list(keys)


async def test_a_tool_that_keeps_timing_out_becomes_its_error_result() -> None:
    agents = {
        "p": {
            **plan_agent(HANG_PLAN, {"tests.runtime.memory_env:HangingTool": {"timeout_s": 0.05}}),
            "max_tool_retries": 0,
        }
    }
    async with open_env(agents) as env:
        reset().hang = True
        sid = await asyncio.wait_for(env.submit("p"), LIMIT_S)
        snap = await env.load(sid)
        # Retries spent: the agent sees the timeout, and the plan has no branch for it.
        assert snap.state is S.FAILED
        assert snap.error is not None and snap.error.code == "unhandled_tool_error"
        assert "call_timed_out" in snap.error.message
        [entry] = snap.tool_log.values()
        assert entry.result == {
            "error": {
                "code": "call_timed_out",
                "message": "CallTimedOut: hang did not finish within 0.05 s",
            }
        }


async def test_a_hung_agent_step_backs_off_then_is_quarantined_and_an_operator_retries() -> None:
    async with open_env({"slow": SLOW_AGENT}, agent_step_timeout_s=0.05) as env:
        probe = reset()
        probe.agent_hangs = True
        sid = await asyncio.wait_for(env.submit("slow"), LIMIT_S)
        assert (await env.load(sid)).retry.used == 1
        await retry_window(env, sid, 1.5, 2.5)
        await asyncio.wait_for(env.runtime.activate(sid, reason=Reason.RETRY), LIMIT_S)
        await retry_window(env, sid, 3.1, 4.9)
        await asyncio.wait_for(env.runtime.activate(sid, reason=Reason.RETRY), LIMIT_S)
        snap = await env.load(sid)
        assert snap.state is S.QUARANTINED
        assert snap.quarantine is not None and snap.quarantine.code == "call_timed_out"
        assert snap.quarantine.attempts == 2 and "agent.step" in snap.quarantine.reason
        states = await env.services.index.session_states([sid])
        assert states[sid] is S.QUARANTINED
        # Set aside: a wake does nothing, and no timer brings it back.
        await env.control.activate_for_event(sid)
        assert (await env.load(sid)).state is S.QUARANTINED
        far = env.clock.now() + timedelta(days=1)
        for kind in (TimerKind.WAKE, TimerKind.RETRY):
            assert await env.services.index.due(kind=kind, now=far, limit=9) == []
        probe.agent_hangs = False
        await asyncio.wait_for(env.control.retry(sid), LIMIT_S)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.quarantine is None and done.retry.used == 0


async def test_an_agent_step_is_told_the_deadline_it_runs_under() -> None:
    """Without it an agent's own retries (an LLM client's) ran on past the step's
    deadline, for nobody, and ended in the runtime's timeout instead of their error."""
    async with open_env({"slow": SLOW_AGENT}, agent_step_timeout_s=120.0) as env:
        probe = reset()
        sid = await asyncio.wait_for(env.submit("slow"), LIMIT_S)
        assert (await env.load(sid)).state is S.COMPLETED
        [(deadline, called_at)] = probe.agent_deadlines
        assert deadline is not None
        # Set as the call starts: at most the step's timeout ahead, less only the moment
        # between setting it and the step reading the clock.
        assert 119.0 < deadline - called_at <= 120.0


async def test_cancel_ends_a_quarantined_session() -> None:
    async with open_env(
        {"slow": {**SLOW_AGENT, "max_tool_retries": 0}}, agent_step_timeout_s=0.05
    ) as env:
        reset().agent_hangs = True
        sid = await asyncio.wait_for(env.submit("slow"), LIMIT_S)
        assert (await env.load(sid)).state is S.QUARANTINED
        await env.control.cancel(sid)
        assert (await env.load(sid)).state is S.CANCELLED


async def test_an_activation_past_its_wall_time_cap_stops_and_retries() -> None:
    agents = {"p": plan_agent(HANG_PLAN, {"tests.runtime.memory_env:HangingTool": {}})}
    async with open_env(agents, activation_max_s=0.2, tool_timeout_s=60.0) as env:
        reset().hang = True
        sid = await asyncio.wait_for(env.submit("p"), LIMIT_S)
        assert (await env.load(sid)).state is S.RUNNING
        assert await retry_due(env, sid, env.clock.now() + env.services.config.retry_delay)
        # The lease was let go rather than renewed for ever.
        lease = await env.services.index.acquire_lease(
            name=lease_name(sid), owner="other", ttl=timedelta(seconds=5), now=env.clock.now()
        )
        assert lease is not None


def approve_agent(**options: Any) -> dict[str, Any]:
    return {
        **plan_agent(APPROVE_PLAN, {"tests.runtime.memory_env:Approve": options}),
        "max_tool_retries": 5,
    }


async def answer(env: MemEnv, sid: str) -> None:
    wait = (await env.load(sid)).waits[0]
    await env.control.deliver(
        InboxEvent.answering(
            wait,
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="oa",
            event_id="evt-1",
            type="oa.approval.decided",
            received_at=env.clock.now(),
            data={"status": "approved"},
        )
    )


async def test_a_failing_guard_backs_off_and_the_sla_still_times_the_session_out() -> None:
    async with open_env({"a": approve_agent(sla_s=600)}) as env:
        probe = reset()
        sid = await env.submit("a")
        assert (await env.load(sid)).state is S.SUSPENDED
        probe.state_fails = True
        await asyncio.wait_for(answer(env, sid), LIMIT_S)
        snap = await env.load(sid)
        assert snap.state is S.RESUMING and snap.retry.used == 1
        await retry_window(env, sid, 1.5, 2.5)
        await env.runtime.activate(sid, reason=Reason.RETRY)
        await retry_window(env, sid, 3.1, 4.9)
        env.clock.advance(601)  # the guard still fails, and the deadline has passed
        await env.runtime.activate(sid, reason=Reason.TIMEOUT)
        done = await env.load(sid)
        assert done.state is S.TIMED_OUT
        assert done.error is not None and done.error.code == "sla_expired"
        assert [c for c, _ in probe.calls].count("current_state") == 3


async def test_a_guard_whose_tool_finds_no_current_state_is_drift() -> None:
    """The budget the approval was asked against was deleted while the session slept:
    the tool's ``current_state`` finds nothing. The guard fails closed (it passed: the
    approval was acted on as if nothing had changed)."""
    async with open_env({"a": approve_agent()}) as env:
        probe = reset()
        sid = await env.submit("a")
        probe.state_gone = True
        await answer(env, sid)
        snap = await env.load(sid)
        assert snap.state is S.COMPLETED and isinstance(snap.result, dict), snap.state
        assert snap.result["status"] == "drift", snap.result
        assert any("gone" in str(r) for r in snap.result["reasons"]), snap.result


async def test_a_tool_with_a_current_state_is_asked_whatever_its_checks_state_says() -> None:
    """A tool that reports the state but left ``checks_state`` at its default: the guard
    never asked it and passed an approval against a budget that had been deleted."""
    tool = "tests.runtime.memory_env:UnflaggedApprove"
    async with open_env(
        {"a": {**plan_agent(APPROVE_PLAN, {tool: {}}), "max_tool_retries": 5}}
    ) as env:
        probe = reset()
        sid = await env.submit("a")
        probe.state_gone = True
        await answer(env, sid)
        snap = await env.load(sid)
        assert [c for c, _ in probe.calls].count("current_state") == 1
        assert isinstance(snap.result, dict) and snap.result["status"] == "drift", snap.result


async def test_a_baseline_no_tool_can_check_is_drift_not_a_pass() -> None:
    """The baseline names a version the tool cannot report (no ``current_state``): the
    guard passed every answer as if it had compared and found nothing changed."""
    tool = "tests.runtime.memory_env:BlindApprove"
    async with open_env(
        {"a": {**plan_agent(APPROVE_PLAN, {tool: {}}), "max_tool_retries": 5}}
    ) as env:
        reset()
        sid = await env.submit("a")
        await answer(env, sid)
        snap = await env.load(sid)
        assert isinstance(snap.result, dict) and snap.result["status"] == "drift", snap.result
        assert any("no tool can report" in str(r) for r in snap.result["reasons"]), snap.result


async def test_a_guard_that_keeps_failing_is_quarantined_when_retries_run_out() -> None:
    agents = {"a": {**approve_agent(), "max_tool_retries": 1}}
    async with open_env(agents) as env:
        probe = reset()
        sid = await env.submit("a")
        probe.state_fails = True
        await answer(env, sid)
        await env.runtime.activate(sid, reason=Reason.RETRY)
        snap = await env.load(sid)
        assert snap.state is S.QUARANTINED and snap.epoch == 1, "the waits stay open"
        assert snap.quarantine is not None and snap.quarantine.code == "guard_unavailable"
        assert snap.quarantine.resume_to is S.SUSPENDED
        # The operator retries once the ERP is back: the event is applied after all.
        probe.state_fails = False
        await env.control.retry(sid)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.result == {"status": "approved"}
