"""One session's bad record must not hold up the sweep's work for every other session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storage import keys
from tests.runtime.test_sweeper import Recording
from tests.support.harness import Env, local_env
from torpor.ports import TimerKind
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


async def test_a_tool_timer_of_an_unreadable_snapshot_does_not_stall_the_others(
    env: Env,
) -> None:
    """A damaged snapshot (or one a newer torpor wrote, mid-upgrade) raised out of the
    tool-timer loop at its member: every timer after it in the due order was leased and
    never delivered, and again at every sweep, for as long as that snapshot stayed."""
    index, now = env.services.index, env.clock.now()
    # The damaged one's members sort first (timers due together come in member order).
    bad, good = sorted([await env.submit(doc="PR-1"), await env.submit(doc="PR-2")])
    bad_wait, good_wait = (await env.load(bad)).waits[0], (await env.load(good)).waits[0]
    await env.services.store.put(keys.snapshot(bad), b"not a snapshot")
    for sid, wait in ((bad, bad_wait), (good, good_wait)):
        member = f"{sid}|{wait.correlation_id}|remind"
        await index.schedule(kind=TimerKind.TOOL, member=member, at=now)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    report = await sweeper.sweep_once()
    pending = await env.services.inbox.pending(good, processed=set())
    assert [e.type for e in pending] == ["torpor.timer.remind"], report.errors


async def test_a_poll_timer_of_an_unreadable_snapshot_does_not_fail_every_sweep(
    env: Env,
) -> None:
    """A poll timer of a damaged snapshot raised out of the poll step at every sweep: no
    sweep was ever recorded complete again (``/healthz`` reported the reconciler stale)."""
    index, now = env.services.index, env.clock.now()
    bad = await env.submit(doc="PR-1")
    wait = (await env.load(bad)).waits[0]
    await env.services.store.put(keys.snapshot(bad), b"not a snapshot")
    await index.schedule(kind=TimerKind.POLL, member=f"{bad}|{wait.correlation_id}", at=now)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.sweep_once()
    report = await sweeper.sweep_once()
    assert not any(e.startswith("polls:") for e in report.errors), report.errors
