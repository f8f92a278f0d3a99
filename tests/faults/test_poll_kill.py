"""kill -9 of the reconciler between taking its due polls and asking the vendor.

A sweep leases its due poll entries (``lease_due``) rather than removing them, so that a
second reconciler does not ask the same question at the same time. The lease must not
outlive the process that took it: a child process runs one real sweep and dies by
SIGKILL at ``sweep.polls_leased`` (the entries taken, no vendor asked). The entry is
then hidden until its lease runs out, and due again after: the next sweep polls, finds
the vendor's decision and the session resumes on it.
"""

from __future__ import annotations

import signal
from pathlib import Path

from tests.faults.sweep_child import killed_sweep
from tests.support.harness import local_env
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.sweeper import POLL_BATCH, POLL_TIMEOUT_S, POLLS_AT_ONCE, Sweeper


async def test_polls_taken_by_a_reconciler_killed_before_it_asked_are_polled_again(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-KP")
        [wait] = (await env.load(sid)).waits
        await env.world.decide("PR-KP", {"status": "approved"})  # the vendor knows already
        # Overdue (polled from now on), well before the deadline.
        env.clock.advance((wait.overdue_after - env.clock.now()).total_seconds() + 1)
        index, now = env.services.index, env.clock.now()
        assert len(await index.due(kind=TimerKind.POLL, now=now, limit=5)) == 1
        code = await killed_sweep(CrashPoint.POLLS_LEASED, tmp_path, redis_url, redis_prefix, now)
        assert code == -signal.SIGKILL
        assert await env.world.counts("poll") == {}, "killed before it asked the vendor"
        assert await index.due(kind=TimerKind.POLL, now=now, limit=5) == [], "leased"
        sweeper = Sweeper(env.control)
        assert (await sweeper.sweep_once(now)).polls == 0, "a second sweep leaves it alone"
        # The lease covers the rounds a full batch takes; past it the entry is due again.
        env.clock.advance(POLL_TIMEOUT_S * (POLL_BATCH // POLLS_AT_ONCE + 1) + 1)
        report = await sweeper.sweep_once(env.clock.now())
        assert (report.polls, report.poll_hits, report.errors) == (1, 1, [])
        assert await env.world.counts("poll") == {wait.correlation_id: 1}
        assert (await env.load(sid)).state is SessionState.COMPLETED
