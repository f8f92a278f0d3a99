"""kill -9 of the reconciler between a retention pass's deletes and the index forgetting
the sessions it purged.

The sweep deletes an ended session's objects, then drops its index entry (its state and
its place in the tenant's listings). A child process runs one real sweep 31 days after
the session ended and dies by SIGKILL at ``sweep.retention_purged``: the snapshot is gone,
the index still lists the session. Repair never drops an entry, and the snapshot that
named the tenant is gone, so the next sweep must still know whose entry to drop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from storage import keys
from storage.listing import exists
from tests.support.harness import local_env
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.service.sweeper import Sweeper

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, sys
from datetime import datetime
from pathlib import Path
from actors.wiring import open_services, session_runtime
from tests.support.harness import settings_for
from torpor.clock import ManualClock
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper

async def main() -> None:
    settings = settings_for(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    services = open_services(settings, clock=ManualClock(datetime.fromisoformat(sys.argv[4])))
    runtime = session_runtime(services, "child")
    await Sweeper(SessionService(services, InlineActivator(runtime))).sweep_once()

asyncio.run(main())
"""


async def test_a_session_purged_by_a_reconciler_killed_before_it_told_the_index_is_forgotten(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-KR")
        await env.answer(sid, {"status": "approved"})
        assert (await env.load(sid)).state is SessionState.COMPLETED
        index, store = env.services.index, env.services.store
        env.clock.advance(timedelta(days=31).total_seconds())
        now = env.clock.now()
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), redis_url, redis_prefix, now.isoformat()],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "TORPOR_CRASH_AT": CrashPoint.RETENTION_PURGED,
            },
            stdout=subprocess.DEVNULL,
        )
        assert await asyncio.to_thread(child.wait, 60) == -signal.SIGKILL
        assert not await exists(store, keys.snapshot(sid)), "purged before the kill"
        assert sid in await index.session_states([sid]), "the index was not told"

        report = await Sweeper(env.control).sweep_once(now)
        assert report.errors == []
        assert await index.session_states([sid]) == {}
        page = await index.list_sessions(tenant="acme", state=None, cursor=None, limit=50)
        assert sid not in page.session_ids
