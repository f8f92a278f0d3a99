"""Retention: ended sessions and every record of theirs leave the store after a while.

A session that ended has an ``ended/{day}/{session}`` marker (``ObjectSnapshots``).
``sweep`` walks those markers oldest day first, a bounded number per call, and deletes a
session whose end is older than the retention period together with its history chunks,
inbox events, the replay markers of the webhooks that carried them, its correlation
records (and business-key pointers still naming them), its deliveries and dead-letter
markers, and the records and progress of its compute work (``torpor.work``). Each sweep
also visits a few batches (round robin over their manifests): one created more than
the period and an hour ago, fanned out (or cancelled), with no session left goes whole,
its documents, fan-out cursor, retry generations, results and cancel marker first, its
manifest last (so a batch cancelled before any session was made goes too); and the
documents of a batch whose manifest never came (found through its accept note). It
deletes the replay markers no inbox event names once past the period and the windows,
found through their due entries oldest hour first (``keys.replay_due``), so a sweep
reads only the markers it may delete. And it compacts the old blocks of a few audit streams into
archives (``storage.audit_archive``): audit records are kept, in fewer objects.

What must outlive it is kept: a session with a delivery still being attempted, or with
an inbox event received within ``windows`` (the 24 h idempotency and replay windows),
waits for a later sweep, and so does one whose work may still be running.

Records are found through the session's refs (``refs/{session}/…``, written beside each
correlation record, delivery and work order). Sessions stored by 0.2 have no refs: their
correlation records, business-key pointers and deliveries are found through the snapshot
(its outbox, waits and business keys) and the inbox events' correlation ids instead.

Deletion order makes a crash harmless: the records first, then what decided they may go
(correlation records, work outcomes and stop markers), then what they were found through
(inbox events, refs), then the snapshot, its history chunks (a session loads whole
until its snapshot goes), any inbox event a late callback wrote meanwhile, and its live
marker, the ended marker last, a window after the snapshot (a callback that found the
session before the purge may store its event later; each visit meanwhile looks again).
A retry finds the marker and resumes with every object left still findable and judged
as before; a marker whose snapshot is gone means only the chunks, late inbox events and
the live marker may be left.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from storage import audit_archive, keys
from storage.audit import MANIFEST
from storage.retention_batches import BATCH_GRACE, SESSIONS_PER_BATCH_VISIT, BatchSweep
from storage.retention_replays import ReplaySweep
from storage.retention_sessions import SessionPurge
from storage.retention_submit_keys import SubmitKeySweep
from storage.snapshots import ended_day
from torpor.ports.repositories import RetentionReport

log = logging.getLogger(__name__)

AUDIT_STREAMS_PER_SWEEP = 8

__all__ = ["BATCH_GRACE", "SESSIONS_PER_BATCH_VISIT", "ObjectRetention"]


class ObjectRetention(SessionPurge, BatchSweep, ReplaySweep, SubmitKeySweep):
    """Retention over an ``ObjectStore``: each sweep compacts a few audit streams and
    purges ended sessions (``storage.retention_sessions``), batches
    (``retention_batches``), replay markers (``retention_replays``) and submit-key
    records (``retention_submit_keys``), over the state of ``retention_state``."""

    async def sweep(
        self, *, now: datetime, keep: timedelta, windows: timedelta, limit: int
    ) -> RetentionReport:
        """Delete up to ``limit`` sessions that ended more than ``keep`` before ``now``."""
        report = await self.sweep_audit(quiet_before=now - audit_archive.QUIET)
        cutoff = now - keep
        last_day = ended_day(cutoff)
        page = await self.store.list(keys.ENDED, start_after=self._cursor, limit=limit)
        self._cursor = page.next_token
        for marker in page.keys:
            day, _, session_id = marker.removeprefix(keys.ENDED).partition("/")
            if day > last_day:
                self._cursor = None  # the rest ended too recently: start over next time
                break
            await self._one(marker, session_id, now, cutoff, windows, report)
        await self.sweep_batches(cutoff, report)
        # Never inside the replay window: the settings take a period of 24 h while a
        # source's tolerance (up to a day) makes the window up to three days, and a
        # marker gone within it lets a captured copy of its request through again.
        await self._sweep_replays(min(cutoff, now - windows), report)
        await self._sweep_submit_keys(min(cutoff, now - windows), report, now=now)
        return report

    async def sweep_audit(self, *, quiet_before: datetime | None = None) -> RetentionReport:
        """Compact the old blocks of a few audit streams (round robin over the manifest);
        a stream with no record since ``quiet_before`` whole (``audit_archive.compact``)."""
        page = await self.store.list(
            MANIFEST, start_after=self._audit_cursor, limit=AUDIT_STREAMS_PER_SWEEP
        )
        self._audit_cursor = page.next_token
        report = RetentionReport()
        for key in page.keys:
            stream = key.removeprefix(MANIFEST)
            # One stream on its own: this runs first in every retention pass, and an
            # error in one stream raised out of the pass, so no session, batch or replay
            # marker was deleted again while that stream stayed as it was.
            try:
                report.archived += await audit_archive.compact(
                    self.store, stream, quiet_before=quiet_before
                )
            except Exception as exc:
                log.warning("audit compaction of stream %s failed", stream[:128], exc_info=True)
                report.errors.append(f"audit stream {stream[:128]}: {type(exc).__name__}: {exc}")
        return report
