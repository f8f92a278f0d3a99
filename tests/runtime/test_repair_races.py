"""Index repair racing the sessions it repairs: what it read may be stale by the time it
writes, and must never undo what a session did meanwhile."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.harness import Env, local_env
from torpor.lifecycle import SessionState
from torpor.models import SessionHeader, WaitingSession
from torpor.service.sweeper import Sweeper


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


async def test_repair_does_not_rebind_a_wait_answered_after_it_read_the_snapshot(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repair reads the live sessions a page at a time and works through them later; a
    wait answered in between (committed, then unbound) was bound again from the stale
    read, and a late or replayed callback to it was then ACCEPTED instead of CLOSED."""
    sid = await env.submit()
    wait = (await env.load(sid)).waits[0]
    snapshots, index = env.services.snapshots, env.services.index
    read_live = snapshots.list_live_waiting

    async def stale(*, now: datetime) -> AsyncIterator[WaitingSession | SessionHeader]:
        read = [session async for session in read_live(now=now)]
        assert await env.answer(sid, {"status": "approved"})  # meanwhile
        assert (await env.load(sid)).state is SessionState.COMPLETED
        for session in read:
            yield session

    monkeypatch.setattr(snapshots, "list_live_waiting", stale)
    await Sweeper(env.control).sweep_once()  # a new sweeper repairs at once
    bound = await index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    assert bound is None, "a closed wait was bound again by repair"
