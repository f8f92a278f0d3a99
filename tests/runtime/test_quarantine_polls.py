"""The poll timer of a session set aside because its snapshot does not decode: dropped
once by the sweep, not failed at every one, and put back by the operator's retry."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from tests.support.harness import local_env
from torpor.lifecycle import SessionState
from torpor.ports import Reason, TimerKind
from torpor.service.sweeper import POLL_BATCH, POLL_TIMEOUT_S, POLLS_AT_ONCE, Sweeper
from torpor.session.suspend import poll_member

pytestmark = pytest.mark.redis
FAR = timedelta(days=365)
# How long a sweep leases the poll entries it takes (``Sweeper._polls``).
POLL_LEASE_S = POLL_TIMEOUT_S * (POLL_BATCH // POLLS_AT_ONCE + 1)


async def test_a_set_aside_sessions_poll_is_dropped_once_and_rearmed_by_the_retry(
    tmp_path: Path, redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-PQ")
        [wait] = (await env.load(sid)).waits
        member = poll_member(sid, wait.correlation_id)
        index, store, key = env.services.index, env.services.store, keys.snapshot(sid)
        good = (await store.get(key)).data
        await store.put(key, good[:-16] + b"\x00" * 16)  # the body spoiled, the header whole
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is SessionState.QUARANTINED
        env.clock.advance((wait.overdue_after - env.clock.now()).total_seconds() + 1)
        assert wait.overdue_after + 4 * timedelta(seconds=POLL_LEASE_S) < wait.deadline
        assert member in await index.due(kind=TimerKind.POLL, now=env.clock.now(), limit=10)

        sweeper = Sweeper(env.control)
        caplog.set_level(logging.WARNING, logger="torpor.service.sweeper_tools")
        polled = []
        for _ in range(3):  # each past the poll's lease: a timer left would be due again
            report = await sweeper.sweep_once()
            polled.append([e for e in report.errors if e.startswith(("poll", "polls"))])
            env.clock.advance(POLL_LEASE_S + 1)
        assert polled == [[], [], []]
        assert await index.due(kind=TimerKind.POLL, now=env.clock.now() + FAR, limit=10) == []
        told = [
            r
            for r in caplog.records
            if r.name == "torpor.service.sweeper_tools" and sid in r.message
        ]
        assert len(told) == 1, [r.message for r in told]

        # The operator restores the snapshot and retries: the poll is asked again.
        await store.put(key, good)
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is SessionState.SUSPENDED
        assert member in await index.due(kind=TimerKind.POLL, now=env.clock.now(), limit=10)
        await env.world.decide("PR-PQ", {"status": "approved"})
        report = await sweeper.sweep_once()
        assert (report.polls, report.poll_hits) == (1, 1), report.errors
        assert (await env.load(sid)).state is not SessionState.SUSPENDED, "the answer ran"
