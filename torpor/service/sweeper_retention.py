"""The sweep's retention (``torpor.service.sweeper``): sessions that ended longer ago than
``storage.retention_s`` deleted with all their records, and then dropped from the index;
never a record a lookup with a window may still need."""

from __future__ import annotations

from datetime import datetime, timedelta

from torpor.faults import CrashPoint, crash_point
from torpor.service.replay import GITHUB_REPLAY_TTL
from torpor.service.sessions import IDEMPOTENCY_TTL
from torpor.service.sweeper_report import SweepReport
from torpor.service.sweeper_tools import SweeperTools
from torpor.session.runtime import lease_name
from torpor.settings import Settings


def lookup_windows(settings: Settings) -> timedelta:
    """How long records stay needed by a lookup that has a window: the submit idempotency
    key, and the replay claims of every webhook source. Retention never deletes inside it."""
    replay = max((3 * s.tolerance_s for s in settings.sources.values()), default=0.0)
    return max(IDEMPOTENCY_TTL, GITHUB_REPLAY_TTL, timedelta(seconds=max(900.0, replay)))


class SweeperRetention(SweeperTools):
    """Ended sessions past the retention period, purged."""

    async def _retention(self, now: datetime, report: SweepReport) -> None:
        retention, storage = self.services.retention, self.services.settings.storage
        if retention is None:
            return
        done = await retention.sweep(
            now=now,
            keep=timedelta(seconds=storage.retention_s),
            windows=lookup_windows(self.services.settings),
            limit=storage.retention_per_sweep,
        )
        # After the objects: repair cannot undo it. Those purged by an earlier pass too:
        # a reconciler killed (or an index error) between that pass's deletes and these
        # left the index listing a session that is gone, and repair never drops one.
        for tenant, session_id in [*done.purged, *done.forget]:
            crash_point(CrashPoint.RETENTION_PURGED)
            await self.services.index.forget_session(tenant=tenant, session_id=session_id)
            # Its lease's fencing counter too: kept past every release so that tokens
            # only grow, it was one index key for every session ever leased. Nothing
            # takes a purged session's lease again (it has no snapshot to commit).
            await self.services.index.drop_lease(name=lease_name(session_id))
        report.purged += len(done.purged)
        report.purged_batches += done.batches
        report.errors += done.errors
