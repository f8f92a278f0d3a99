"""A batch retry killed -9 after it recorded its generation, before it made the
generation's sessions, is finished by the reconciler: the retried documents get their
new session without anyone asking for the retry again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_batches import FLAKY
from tests.support.crash import run_killed_at
from tests.support.harness import local_env
from torpor.errors import SessionNotFound
from torpor.faults import CrashPoint
from torpor.service.batches import BatchService
from torpor.service.sweeper import Sweeper

pytestmark = pytest.mark.redis

EXTRA = {"agents": {"flaky": {"factory": "tests.runtime.test_batches:FlakyAgent"}}}
RETRY_IN_CHILD = """
import asyncio, sys
from pathlib import Path
from tests.support.harness import local_env
from torpor.service.batches import BatchService

async def main() -> None:
    extra = {"agents": {"flaky": {"factory": "tests.runtime.test_batches:FlakyAgent"}}}
    async with local_env(Path(sys.argv[1]), sys.argv[2], sys.argv[3], extra=extra) as env:
        await BatchService(env.control).retry("b_retry")

asyncio.run(main())
"""


async def test_a_retry_killed_before_its_sessions_is_finished_by_the_reconciler(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Nothing but a second retry made the killed one's sessions: asked for by no one,
    the document stayed PENDING (its batch unfinished, its results refused) until the
    retention period, and then counted as done, never processed again."""
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        batches = BatchService(env.control)
        await batches.submit(
            tenant="acme",
            agent="flaky",
            batch_id="b_retry",
            documents=[{"doc": 0}, {"doc": 1, "fail": 1}],
        )
        assert (await batches.progress("b_retry")).by_state == {"COMPLETED": 1, "FAILED": 1}
    run_killed_at(CrashPoint.BATCH_RETRY, RETRY_IN_CHILD, str(tmp_path), redis_url, redis_prefix)
    FLAKY["on"] = False  # the retried document now goes through
    try:
        async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
            batches = BatchService(env.control)
            retried = (await batches.get("b_retry")).session_id(1, attempt=1)
            with pytest.raises(SessionNotFound):
                await env.services.snapshots.header(retried)  # killed before making it
            assert (await batches.progress("b_retry")).by_state == {"COMPLETED": 1, "PENDING": 1}
            sweeper = Sweeper(env.control)
            env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
            assert (await sweeper.sweep_once()).fan_outs == 1
            await sweeper.batches.drain()
            assert (await env.load(retried)).state.value == "COMPLETED"
            progress = await batches.progress("b_retry")
            assert progress.by_state == {"COMPLETED": 2} and progress.finished
            # Done: a later sweep finds nothing left to make.
            env.clock.advance(3600)
            assert (await sweeper.sweep_once()).fan_outs == 0
    finally:
        FLAKY["on"] = True
