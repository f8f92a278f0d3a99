"""Fan-in members and the reconciler, on real Redis: the SLA sweep and index repair both
handle several waits of one session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.runtime import fanin_tools
from tests.runtime.test_fan_in import answer, member, tool_agent
from tests.runtime.test_sweeper import flush_index
from tests.support.harness import Env, local_env
from torpor.lifecycle import SessionState
from torpor.service.sweeper import Sweeper

S = SessionState


def agents(fan_in: dict[str, Any], **tool: Any) -> dict[str, Any]:
    return {"agents": {"t": tool_agent(fan_in, **tool)}}


@pytest.fixture
async def proceed(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    fan_in = {"condition": "n_of_m", "n": 2, "on_expiry": "proceed_with_arrived"}
    extra = agents(fan_in, sla={"a": 60, "b": 60})
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        yield env


async def submit(env: Env) -> str:
    return (await env.control.submit(tenant="acme", agent="t", input=None)).session_id


async def test_repair_rebinds_every_member_of_a_group(
    proceed: Env, redis_url: str, redis_prefix: str
) -> None:
    env = proceed
    fanin_tools.reset()
    sid = await submit(env)
    snap = await env.load(sid)
    await flush_index(redis_url, redis_prefix)
    report = await Sweeper(env.control).sweep_once()
    assert report.repaired_waits == 3
    for wait in snap.waits:
        found = await env.services.index.resolve(
            tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
        )
        assert found is not None and found.session_id == sid
    await answer(env, sid, member(snap, "c"), 30)  # type: ignore[arg-type]
    assert (await env.load(sid)).fan_ins[0].members[2].status.value == "answered"


async def test_one_sweep_times_out_two_expired_members_with_one_activation(proceed: Env) -> None:
    env = proceed
    record = fanin_tools.reset()
    sid = await submit(env)
    snap = await env.load(sid)
    env.clock.advance(61)
    report = await Sweeper(env.control).sweep_once()
    assert report.timeouts == 1, "two due members, one session, one timeout activation"
    done = await env.load(sid)
    # two of three can no longer be met: the group resolves with what arrived (nothing)
    assert done.state is S.COMPLETED and done.result is not None
    assert done.result["expired"] == ["a", "b"]  # type: ignore[index,call-overload]
    assert done.result["cancelled"] == ["c"]  # type: ignore[index,call-overload]
    # c closed unanswered; a and b expired: every request the session no longer waits
    # for is undone, each once.
    assert sorted((a, why) for a, why, _ in record.compensated) == [
        ("quote:a", "deadline passed"),
        ("quote:b", "deadline passed"),
        ("quote:c", "fan-in resolved"),
    ]
    later = env.clock.now() + timedelta(seconds=1)
    assert await env.services.index.due_deadlines(now=later, limit=10) == []
    for wait in snap.waits:
        assert (
            await env.services.index.resolve(
                tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
            )
            is None
        )
