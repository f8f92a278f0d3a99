"""A tool timer (an approval's reminder, its escalation) of a session set aside because its
snapshot does not decode: dropped once by the sweep, not failed at every one, and put
back by the operator's retry."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from tests.runtime import approval_tools
from tests.runtime.approval_tools import approval_agent
from tests.support.harness import Env, local_env
from torpor.lifecycle import SessionState
from torpor.models import ObservationReason
from torpor.ports import Reason, TimerKind
from torpor.service.sweeper import Sweeper
from torpor.session.suspend import tool_timer_member

pytestmark = pytest.mark.redis
FAR = timedelta(days=365)
# One timer each: the one that fires first, at 1,200 s (the deadline is at 3,600 s).
TIMERS = {
    "remind-0": {"sla_s": 3600, "remind_before_s": [2400]},
    "escalate-1": {"sla_s": 3600, "escalation": ["cfo"], "escalate_after_s": 1200},
}


@pytest.fixture(autouse=True)
def oa() -> Iterator[None]:
    approval_tools.reset()
    yield
    approval_tools.reset()


@dataclass
class SetAside:
    env: Env
    sid: str
    member: str
    good: bytes  # the snapshot as it was, for the operator to restore


@asynccontextmanager
async def set_aside(
    tmp_path: Path, redis_url: str, redis_prefix: str, timer: str
) -> AsyncIterator[SetAside]:
    """An approval waiting on its one tool timer, its snapshot spoiled and the session
    set aside by the activation that found it so; the clock just past the timer's time."""
    agents = {"approval": approval_agent(stages=[{"approvers": ["fd"]}], **TIMERS[timer])}
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": agents}) as env:
        submitted = await env.control.submit(
            tenant="acme", agent="approval", input={"doc": "PR-T", "amount": 500, "cc": "CC-7"}
        )
        sid = submitted.session_id
        [wait] = (await env.load(sid)).waits
        member = tool_timer_member(sid, wait.correlation_id, timer)
        index, store, key = env.services.index, env.services.store, keys.snapshot(sid)
        good = (await store.get(key)).data
        await store.put(key, good[:-16] + b"\x00" * 16)  # the body spoiled, the header whole
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED
        due_at = wait.opened_at + timedelta(seconds=1200)
        env.clock.advance((due_at - env.clock.now()).total_seconds() + 1)
        lease = timedelta(seconds=env.services.settings.reconciler.wake_grace_s)
        assert due_at + 4 * lease < wait.deadline, "the sweeps below stay before it"
        assert await index.due(kind=TimerKind.TOOL, now=env.clock.now(), limit=10) == [member]
        yield SetAside(env, sid, member, good)


@pytest.mark.parametrize("timer", list(TIMERS))
async def test_a_set_aside_sessions_tool_timer_is_dropped_once_and_rearmed_by_the_retry(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    caplog: pytest.LogCaptureFixture,
    timer: str,
) -> None:
    async with set_aside(tmp_path, redis_url, redis_prefix, timer) as aside:
        env, sid, member = aside.env, aside.sid, aside.member
        index = env.services.index
        sweeper = Sweeper(env.control)
        caplog.set_level(logging.WARNING, logger="torpor.service.sweeper_tools")
        failed = []
        for _ in range(3):  # each past the timer's lease: a timer left would be due again
            report = await sweeper.sweep_once()
            failed.append([e for e in report.errors if e.startswith(("tool timer", "tool_timers"))])
            env.clock.advance(sweeper.timer_lease.total_seconds() + 1)
        assert failed == [[], [], []]
        assert await index.due(kind=TimerKind.TOOL, now=env.clock.now() + FAR, limit=10) == []
        told = [
            r
            for r in caplog.records
            if r.name == "torpor.service.sweeper_tools" and sid in r.message
        ]
        assert len(told) == 1, [r.message for r in told]
        assert member in told[0].message

        # The operator restores the snapshot and retries: the timer is due again, and fires.
        await env.services.store.put(keys.snapshot(sid), aside.good)
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is SessionState.SUSPENDED
        assert await index.due(kind=TimerKind.TOOL, now=env.clock.now(), limit=10) == [member]
        report = await sweeper.sweep_once()
        assert report.errors == []
        snap = await env.load(sid)
        reasons = [o.reason for o in snap.observations]
        if timer == "remind-0":
            assert reasons == [ObservationReason.REMINDER]
        else:
            assert reasons == [ObservationReason.ESCALATED]
            assert snap.waits[0].request["approvers"] == ["cfo"]


async def test_a_retry_rearms_a_tool_timer_a_sweep_leased_before_the_restore(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """A sweep leased the timer, then read the snapshot undecodable after the operator's
    retry had re-armed it: its drop (``if_at`` its lease) leaves the re-armed entry. A
    retry that only made sure the entry exists left it at the lease's end, and the drop
    removed it."""
    async with set_aside(tmp_path, redis_url, redis_prefix, "remind-0") as aside:
        env, index = aside.env, aside.env.services.index
        until = env.clock.now() + Sweeper(env.control).timer_lease
        leased = await index.lease_due(
            kind=TimerKind.TOOL, now=env.clock.now(), limit=10, until=until
        )
        assert leased == [aside.member]
        await env.services.store.put(keys.snapshot(aside.sid), aside.good)
        await env.control.retry(aside.sid, tenant="acme")
        await index.unschedule(kind=TimerKind.TOOL, member=aside.member, if_at=until)  # the drop
        due = await index.due(kind=TimerKind.TOOL, now=env.clock.now(), limit=10)
        assert due == [aside.member]
