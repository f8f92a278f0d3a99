"""kill -9 of the reconciler between a retention pass's deletes and the index forgetting
the sessions it purged.

The sweep deletes an ended session's objects, then drops its index entry (its state and
its place in the tenant's listings). A child process runs one real sweep 31 days after
the session ended and dies by SIGKILL at ``sweep.retention_purged``: the snapshot is gone,
the index still lists the session. Repair never drops an entry, and the snapshot that
named the tenant is gone, so the next sweep must still know whose entry to drop.
"""

from __future__ import annotations

import signal
from datetime import timedelta
from pathlib import Path

from storage import keys
from storage.listing import exists
from tests.faults.sweep_child import killed_sweep
from tests.support.harness import local_env
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.service.sweeper import Sweeper


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
        code = await killed_sweep(
            CrashPoint.RETENTION_PURGED, tmp_path, redis_url, redis_prefix, now
        )
        assert code == -signal.SIGKILL
        assert not await exists(store, keys.snapshot(sid)), "purged before the kill"
        assert sid in await index.session_states([sid]), "the index was not told"

        report = await Sweeper(env.control).sweep_once(now)
        assert report.errors == []
        assert await index.session_states([sid]) == {}
        page = await index.list_sessions(tenant="acme", state=None, cursor=None, limit=50)
        assert sid not in page.session_ids
