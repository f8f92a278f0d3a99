"""Retention: ended sessions and every record of theirs leave the store after a while.

A session that ended has an ``ended/{day}/{session}`` marker (``ObjectSnapshots``).
``sweep`` walks those markers oldest day first, a bounded number per call, and deletes a
session whose end is older than the retention period together with its history chunks,
inbox events, the replay markers of the webhooks that carried them, its correlation
records (and business-key pointers still naming them), its deliveries and dead-letter
markers, and its batch's manifest once no session of the batch is left. Each sweep
also compacts the old blocks of a few audit streams into archives
(``storage.audit_archive``): audit records are kept, in fewer objects.

What must outlive it is kept: a session with a delivery still being attempted, or with
an inbox event received within ``windows`` (the 24 h idempotency and replay windows),
waits for a later sweep. Deletion order makes a crash harmless: everything else first,
the snapshot second to last, the marker last, so a retry finds the marker and resumes; a
marker whose snapshot is gone means the rest is gone too.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import TypeVar

from pydantic import ValidationError

from storage import audit_archive, keys
from storage.audit import MANIFEST
from storage.listing import all_keys
from storage.snapshots import ObjectSnapshots, ended_day
from torpor.batches import BatchManifest
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import ObjectNotFound, SessionNotFound, SnapshotCorrupt
from torpor.events import InboxEvent
from torpor.ids import session_id_ms
from torpor.ports import ObjectStore
from torpor.ports.repositories import RetentionReport

DELETES_AT_ONCE = 16
AUDIT_STREAMS_PER_SWEEP = 8
T = TypeVar("T", InboxEvent, Delivery, BatchManifest)


class ObjectRetention:
    def __init__(self, store: ObjectStore, snapshots: ObjectSnapshots | None = None) -> None:
        self.store = store
        self.snapshots = snapshots or ObjectSnapshots(store)
        # Where the last sweep stopped: sessions kept back do not starve the ones after.
        self._cursor: str | None = None
        self._audit_cursor: str | None = None

    async def sweep(
        self, *, now: datetime, keep: timedelta, windows: timedelta, limit: int
    ) -> RetentionReport:
        """Delete up to ``limit`` sessions that ended more than ``keep`` before ``now``."""
        report = await self.sweep_audit()
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
        return report

    async def sweep_audit(self) -> RetentionReport:
        """Compact the old blocks of a few audit streams (round robin over the manifest)."""
        page = await self.store.list(
            MANIFEST, start_after=self._audit_cursor, limit=AUDIT_STREAMS_PER_SWEEP
        )
        self._audit_cursor = page.next_token
        report = RetentionReport()
        for key in page.keys:
            report.archived += await audit_archive.compact(self.store, key.removeprefix(MANIFEST))
        return report

    async def _one(
        self,
        marker: str,
        session_id: str,
        now: datetime,
        cutoff: datetime,
        windows: timedelta,
        report: RetentionReport,
    ) -> None:
        try:
            snapshot = await self.snapshots.load(session_id)
        except SessionNotFound:  # an earlier sweep got this far: only the marker is left
            await self.store.delete(marker)
            return
        except SnapshotCorrupt:
            report.kept += 1  # never delete what cannot be read: an operator looks first
            return
        if not snapshot.terminal:  # a stale marker; the session is not ended after all
            await self.store.delete(marker)
            return
        born_ms = session_id_ms(session_id)
        young = born_ms is not None and born_ms > (now - windows).timestamp() * 1000
        if snapshot.updated_at > cutoff:
            # Changed after it ended (e.g. its outbox settled): file it under that day.
            await self.snapshots.mark_ended(session_id, snapshot.updated_at)
            if marker != keys.ended(ended_day(snapshot.updated_at), session_id):
                await self.store.delete(marker)
            report.kept += 1
            return
        if young:  # only with a retention shorter than the windows, which settings refuse
            report.kept += 1
            return
        doomed = await self._records(session_id, now - windows)
        if doomed is None:
            report.kept += 1
            return
        if snapshot.batch_id and await self._batch_done(snapshot.batch_id, session_id):
            doomed.append(keys.batch(snapshot.batch_id))
        await self._delete(doomed)
        await self.store.delete(keys.snapshot(session_id))
        await self.store.delete(keys.live(session_id))
        await self.store.delete(marker)
        report.objects += len(doomed) + 2
        report.purged.append((snapshot.tenant, session_id))

    async def _records(self, session_id: str, window_start: datetime) -> list[str] | None:
        """Every object of the session but its snapshot, or None if one is still needed."""
        doomed: list[str] = []
        for event_key in await self._list(keys.inbox_prefix(session_id)):
            doomed.append(event_key)
            event = await self._read(event_key, InboxEvent)
            if event is None:
                continue
            if event.received_at > window_start:
                return None  # its replay marker still guards the replay window
            if event.content_digest:
                doomed.append(keys.accepted_content(event.source, event.content_digest))
        refs = keys.refs_prefix(session_id)
        for ref in await self._list(refs):
            doomed.append(ref)
            kind, _, rest = ref.removeprefix(refs).partition("/")
            if kind == "c":
                doomed.append(keys.correlation(rest))
                pointer = await self._data(ref)
                if pointer and await self._data(pointer.decode()) == rest.encode():
                    doomed.append(pointer.decode())  # the business key still names ours
            elif kind == "d":
                tenant, _, delivery_id = rest.partition("/")
                delivery = await self._read(keys.delivery(tenant, delivery_id), Delivery)
                if delivery is not None and delivery.status is DeliveryStatus.PENDING:
                    return None  # still being attempted
                doomed.append(keys.delivery(tenant, delivery_id))
                doomed.append(keys.dead_letter(tenant, delivery_id))
        doomed += await self._list(keys.chunk_prefix(session_id))
        return doomed

    async def _batch_done(self, batch_id: str, leaving: str) -> bool:
        """Whether ``leaving`` is the last session of its batch still stored."""
        manifest = await self._read(keys.batch(batch_id), BatchManifest)
        if manifest is None:
            return False
        for other in manifest.session_ids:
            if other == leaving:
                continue
            try:
                await self.snapshots.header(other)
            except SessionNotFound:
                continue
            except SnapshotCorrupt:
                return False
            return False  # found one still there (the common case stops at the first)
        return True

    async def _delete(self, doomed: list[str]) -> None:
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str) -> None:
            async with gate:
                await self.store.delete(key)

        await asyncio.gather(*(one(k) for k in doomed))

    async def _list(self, prefix: str) -> list[str]:
        return await all_keys(self.store, prefix)

    async def _data(self, key: str) -> bytes | None:
        try:
            return (await self.store.get(keys.check_object_key(key))).data
        except ObjectNotFound:
            return None

    async def _read(self, key: str, model: type[T]) -> T | None:
        data = await self._data(key)
        if data is None:
            return None
        try:
            return model.model_validate_json(data)
        except ValidationError:
            return None
