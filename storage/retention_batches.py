"""Retention of batches (``storage.retention``): a few visited a sweep (round robin over
their manifests), one past the period and its grace, fanned out (or cancelled) and with
no session left deleted whole, its manifest last; and the documents of a batch whose
manifest never came, found through its accept note."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from storage import keys
from storage.listing import exists
from storage.retention_state import DELETES_AT_ONCE, RetentionState
from torpor.batches import BatchManifest, FanOutCursor, RetryGeneration
from torpor.errors import (
    InvalidKey,
    SessionNotFound,
    SnapshotError,
)
from torpor.ports.repositories import RetentionReport

BATCHES_PER_SWEEP = 8
# A batch's sessions looked for at most in one visit (a sweep is one step of the
# reconciler's loop, which wakes sessions and fires timers: it must stay short).
SESSIONS_PER_BATCH_VISIT = 256
# Past the retention period a batch takes no retry (``BatchService.retry``); one that
# began just before has this long to make its sessions before the batch may go.
BATCH_GRACE = timedelta(hours=1)


class BatchSweep(RetentionState):
    """The sweep of batches, and of the documents of batches never accepted."""

    async def sweep_batches(self, cutoff: datetime, report: RetentionReport) -> None:
        """Visit a few batches (round robin over the manifests) and delete those created
        ``BATCH_GRACE`` before ``cutoff`` that nothing may still add a session to and that
        have none left. A batch's sessions end and go on their own schedule; the batch is
        judged by its manifest's age and what is left of it, not by whichever of its
        sessions goes last (a batch cancelled before its fan-out made any session has
        none to go last)."""
        page = await self.store.list(
            keys.BATCHES, start_after=self._batch_cursor, limit=BATCHES_PER_SWEEP
        )
        self._batch_cursor = page.next_token
        for key in page.keys:
            deleted = await self._batch(key, cutoff - BATCH_GRACE)
            if deleted:
                report.batches += 1
                report.objects += deleted
        await self._sweep_unaccepted(cutoff - BATCH_GRACE, report)

    async def _sweep_unaccepted(self, cutoff: datetime, report: RetentionReport) -> None:
        """Visit a few accept notes (round robin): documents whose manifest never came
        are named by nothing else."""
        page = await self.store.list(
            keys.BATCH_ACCEPTS, start_after=self._accept_cursor, limit=BATCHES_PER_SWEEP
        )
        self._accept_cursor = page.next_token
        for key in page.keys:
            report.objects += await self._unaccepted(key, cutoff)

    async def _unaccepted(self, note: str, cutoff: datetime) -> int:
        """Delete the documents of a batch whose accept began before ``cutoff`` and never
        wrote its manifest (it died, or the batch was refused after its rows were stored
        by reference), then the note; a note beside a manifest only goes itself (the
        accept died after the manifest: the batch is judged by its manifest). Past the
        period, no accept of the batch is still under way: a retry of the request starts
        again, and writes its note again first."""
        batch_id = note.removeprefix(keys.BATCH_ACCEPTS)
        if await exists(self.store, keys.batch(batch_id)):
            await self.store.delete(note)
            return 1
        try:
            at = await self._stored_time(note)
        except ValueError:
            return 0  # unreadable: an operator looks first
        if at is None or at > cutoff:
            return 0  # gone since the listing, or an accept perhaps still under way
        beside = await self._list(keys.batch_data(batch_id))
        await self._delete(beside)
        # A fan-out marker of an accept that died between it and the manifest.
        await self.store.delete(keys.fanout(batch_id))
        await self.store.delete(note)
        return len(beside) + 1

    async def _batch(self, key: str, cutoff: datetime) -> int:
        manifest = await self._read(key, BatchManifest)
        if manifest is None or manifest.created_at > cutoff:
            return 0  # young, gone since the listing, or unreadable (an operator looks first)
        batch_id = manifest.batch_id
        if not await self._fanned_out(manifest):
            return 0  # the reconciler may still give a document its session
        if await self._session_left(manifest):
            return 0
        beside = await self._list(keys.batch_data(batch_id))
        # What decided the batch may go (its cursor, its cancel marker) after the rest,
        # and the manifest, through which a retry after a crash finds all of it, last.
        deciding = {keys.batch_cursor(batch_id), keys.batch_cancelled(batch_id)}
        await self._delete([k for k in beside if k not in deciding])
        # A fan-out marker left by a fan-out that died after its last cursor write.
        await self.store.delete(keys.fanout(batch_id))
        await self._delete([k for k in beside if k in deciding])
        await self.store.delete(key)
        # A cancel or an export that read the manifest before it went may have written
        # beside it since the listing: nothing would find that again.
        late = await self._list(keys.batch_data(batch_id))
        await self._delete(late)
        self._batch_gone.pop(batch_id, None)
        return len(beside) + len(late) + 1

    async def _fanned_out(self, manifest: BatchManifest) -> bool:
        """Whether every document has had its session made, or never will: a manifest
        with no ``total`` was fanned out before its 202; a newer one by its cursor; a
        cancelled batch makes no more. Its documents are written before its manifest, so
        a manifest without them is one a purge had judged already (and then crashed)."""
        batch_id = manifest.batch_id
        if not manifest.total or await exists(self.store, keys.batch_cancelled(batch_id)):
            return True
        if manifest.documents_key is None:
            return True  # from before documents were kept: no fan-out can make its sessions
        if not await exists(self.store, keys.check_object_key(manifest.documents_key)):
            return True
        cursor = await self._read(keys.batch_cursor(batch_id), FanOutCursor)
        return cursor is not None and cursor.next >= manifest.size

    async def _session_left(self, manifest: BatchManifest) -> bool:
        """Whether any session the batch ever made (each document's first, and each retry
        generation's) is still stored. Looked at last to first, a bounded number a visit,
        from where the last visit found one still there: sessions end and go roughly in
        document order, so a visit usually reads one header; a batch whose sessions are
        all gone is read through once, over as many visits as it takes. A session gone
        stays gone: the batch is past the period in which it can be retried
        (``BatchService.retry``) and past its fan-out."""
        batch_id = manifest.batch_id
        sessions = [manifest.session_id(i) for i in range(manifest.size)]
        for key in await self._list(keys.batch_retries(batch_id)):
            generation = await self._read(key, RetryGeneration)
            if generation is None:
                return True  # which sessions it made cannot be told: kept
            sessions += [
                manifest.session_id(i, generation.generation) for i in generation.documents
            ]
        sessions.reverse()
        start = self._batch_gone.pop(batch_id, 0)
        end = min(len(sessions), start + SESSIONS_PER_BATCH_VISIT)
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def stored(session_id: str) -> bool:
            async with gate:
                try:
                    await self.snapshots.header(session_id)
                except SessionNotFound:
                    return False
                except (SnapshotError, InvalidKey):
                    pass  # stored, if unreadable (or a newer torpor's): an operator looks first
                return True

        found = await asyncio.gather(*(stored(sid) for sid in sessions[start:end]))
        first = next((start + n for n, there in enumerate(found) if there), None)
        if first is None and end == len(sessions):
            return False
        self._batch_gone[batch_id] = end if first is None else first
        if len(self._batch_gone) > 10_000:  # forgotten: read through again, from the start
            self._batch_gone.popitem(last=False)
        return True
