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

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from pydantic import ValidationError

from storage import audit_archive, keys, submit_keys
from storage.audit import MANIFEST
from storage.inbox import replay_hour
from storage.listing import all_keys, exists
from storage.snapshots import ObjectSnapshots, ended_day
from torpor.batches import BatchManifest, FanOutCursor, RetryGeneration
from torpor.deliveries import Delivery, DeliveryStatus, delivery_id_for
from torpor.errors import (
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
    SessionNotFound,
    SnapshotError,
)
from torpor.events import InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ids import session_id_ms
from torpor.models import OutboxKind, SessionSnapshot
from torpor.ports import ObjectStore, StoredObject, WaitBinding
from torpor.ports.repositories import RetentionReport
from torpor.work import WorkOrder, work_id

log = logging.getLogger(__name__)

DELETES_AT_ONCE = 16
AUDIT_STREAMS_PER_SWEEP = 8
BATCHES_PER_SWEEP = 8
REPLAYS_PER_SWEEP = 256  # replay markers one sweep may delete (one read each)
SUBMIT_KEYS_PER_SWEEP = 256  # submit-key records one sweep looks at (one read each)
# A pass over every submit-key record starts at most this often. A record goes only a
# retention period and a window after it was written, so an hour's wait delays no
# deletion by much, and a deployment with many records is not read a page every sweep
# (every 5 s) for ever.
SUBMIT_KEYS_PASS_EVERY = timedelta(hours=1)
# A batch's sessions looked for at most in one visit (a sweep is one step of the
# reconciler's loop, which wakes sessions and fires timers: it must stay short).
SESSIONS_PER_BATCH_VISIT = 256
# Past the retention period a batch takes no retry (``BatchService.retry``); one that
# began just before has this long to make its sessions before the batch may go.
BATCH_GRACE = timedelta(hours=1)
T = TypeVar("T", InboxEvent, Delivery, BatchManifest, WaitBinding, FanOutCursor, RetryGeneration)
COMPENSATE_SUFFIX = ":compensate"  # a COMPENSATE entry's key: its START key + this


@dataclass
class Doomed:
    """A session's objects in the order they go. Each phase was found through objects a
    later phase deletes, so a crash between phases leaves the rest findable."""

    records: list[str] = field(default_factory=list)
    # Deliveries → the etag each was judged settled at: each goes only if unchanged since
    # (``_delete_deliveries``), before the other records.
    deliveries: dict[str, str] = field(default_factory=dict)
    # Business-key pointers → the correlation ids that make each ours (waits of several
    # epochs may have used one key). Deleted with the records, each only if it still
    # names one of them when it goes (``_delete_pointers``).
    pointers: dict[str, set[str]] = field(default_factory=dict)
    # What told the records may go: correlation records (a 0.2 business-key pointer is
    # known to be ours by the record it names) and work outcomes and stop markers (work
    # with neither may still run, see ``_work_over``).
    deciding: list[str] = field(default_factory=list)
    # Inbox events and refs: what the phases before were found through.
    finders: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return (
            len(self.records)
            + len(self.deliveries)
            + len(self.pointers)
            + len(self.deciding)
            + len(self.finders)
        )


class ObjectRetention:
    def __init__(self, store: ObjectStore, snapshots: ObjectSnapshots | None = None) -> None:
        self.store = store
        self.snapshots = snapshots or ObjectSnapshots(store)
        # Where the last sweep stopped: sessions kept back do not starve the ones after.
        self._cursor: str | None = None
        self._audit_cursor: str | None = None
        self._batch_cursor: str | None = None
        self._accept_cursor: str | None = None
        self._replay_cursor: str | None = None  # the one-time pass over the markers
        self._replays_indexed = False  # that pass was made (``keys.REPLAYS_LISTED``)
        self._submit_cursor: str | None = None
        self._submit_pass_after: datetime | None = None  # the next pass, not before
        # How many of each batch's sessions (in the order they are looked at) are known
        # gone: the next visit starts there, at the one found still stored last time.
        self._batch_gone: OrderedDict[str, int] = OrderedDict()

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

    async def _sweep_submit_keys(
        self, cutoff: datetime, report: RetentionReport, *, now: datetime
    ) -> None:
        """Visit a page of submit-key records (round robin, a pass over them all at most
        once per ``SUBMIT_KEYS_PASS_EVERY``) and delete those written before ``cutoff``
        whose session was never made: the record is written before the session, so a
        create that failed (an outage) and that no retry of the key took over left it,
        and its ref, naming a session no purge would ever visit. A record whose session
        exists goes with it (``_records``)."""
        if self._submit_cursor is None:
            if self._submit_pass_after is not None and now < self._submit_pass_after:
                return
            self._submit_pass_after = now + SUBMIT_KEYS_PASS_EVERY
        page = await self.store.list(
            keys.SUBMIT_KEYS, start_after=self._submit_cursor, limit=SUBMIT_KEYS_PER_SWEEP
        )
        self._submit_cursor = page.next_token
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str) -> int:
            try:
                tenant, hashed = keys.submit_key_parts(key)
            except InvalidKey:
                return 0  # not a record of ours (a stray object): left for an operator
            async with gate:
                found = await self._stored(key)
                if found is None:
                    return 0
                try:
                    record = submit_keys.decode(found.data)
                except (ValueError, KeyError, TypeError, InvalidKey):
                    return 0  # unreadable: left for an operator, as other records are
                at = record.created_at
                if at.tzinfo is None or at > cutoff:
                    return 0  # its request may still make the session
                try:
                    await self.snapshots.header(record.session_id)
                    return 0
                except SessionNotFound:
                    pass
                except (SnapshotError, InvalidKey):
                    return 0  # stored, if unreadable: an operator looks first
                await self.store.delete(keys.submit_key_ref(record.session_id, tenant, hashed))
                # Conditional: a later request may take the key over (its 24 h are long
                # past) for a session it is making right now.
                return 1 + await self.store.delete_if_match(key, etag=found.etag)

        report.objects += sum(await asyncio.gather(*(one(k) for k in page.keys)))

    async def _sweep_replays(self, cutoff: datetime, report: RetentionReport) -> None:
        """Delete replay markers stamped before ``cutoff``, up to a page of them. A
        session's purge deletes the markers its inbox events name, but a request that
        stored nothing new (a duplicate resent signed afresh, a batch whose events all
        named no wait) is answered 2xx and remembered all the same, by a marker no event
        names. Past the retention period and the window no signature window is open for
        it. Unstamped markers (before stamps) are left to the purge.

        The markers are found through their due entries (``keys.replay_due``), oldest
        hour first, and the walk stops at the cutoff's hour: a sweep reads only markers
        it may delete (an hour late at most), and one with none due costs one listing.
        Round robin over the markers themselves, every sweep read a page of them for
        ever, the same young ones again and again."""
        if not await self._replays_listed():
            await self._list_replays(cutoff, report)
        last_hour = replay_hour(cutoff)
        page = await self.store.list(keys.REPLAYS_DUE, limit=REPLAYS_PER_SWEEP)
        due: list[tuple[str, str]] = []
        for key in page.keys:
            try:
                hour, source, content_digest = keys.replay_due_parts(key)
            except InvalidKey:
                continue  # not an entry of ours (a stray object): left for an operator
            if hour >= last_hour:
                break  # every entry after it is as young or younger
            due.append((key, keys.accepted_content(source, content_digest)))
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(entry: str, marker: str) -> int:
            async with gate:
                gone, _ = await self._delete_old_replay(marker, cutoff)
                crash_point(CrashPoint.REPLAY_MARKER_SWEPT)
                # After the marker: a crash between leaves the entry, which finds it again.
                await self.store.delete(entry)
                return gone + 1

        report.objects += sum(await asyncio.gather(*(one(e, m) for e, m in due)))

    async def _delete_old_replay(
        self, marker: str, cutoff: datetime
    ) -> tuple[int, datetime | None]:
        """Delete ``marker`` if it is stamped before ``cutoff``: (1 if it went, else 0;
        its stamp, None if it has none). Judged by its own stamp, not its entry's hour: a
        marker deleted (a purge) and written again by a later request has a younger
        stamp, and an entry of its own."""
        found = await self._stored(marker)
        # Gone: deleted with its session's inbox, or taken back by its request.
        at = None if found is None else _stamp(found.data)
        if found is None or at is None or at >= cutoff:
            return 0, at
        return int(await self.store.delete_if_match(marker, etag=found.etag)), at

    async def _replays_listed(self) -> bool:
        """Whether every marker stored before due entries existed has one by now."""
        if not self._replays_indexed:
            self._replays_indexed = await exists(self.store, keys.REPLAYS_LISTED)
        return self._replays_indexed

    async def _list_replays(self, cutoff: datetime, report: RetentionReport) -> None:
        """One pass over the markers themselves, a page a sweep, made once per store:
        a marker stored before due entries existed has none. One stamped before
        ``cutoff`` goes, any other stamped one is given its entry; the pass's end is
        recorded (``keys.REPLAYS_LISTED``). A process of an older version still writing
        markers after that leaves them to the purge (those its inbox events name)."""
        page = await self.store.list(
            keys.REPLAYS, start_after=self._replay_cursor, limit=REPLAYS_PER_SWEEP
        )
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(marker: str) -> int:
            try:
                source, content_digest = keys.accepted_content_parts(marker)
            except InvalidKey:
                return 0  # not a marker of ours (a stray object): left for an operator
            async with gate:
                gone, at = await self._delete_old_replay(marker, cutoff)
                if gone or at is None:
                    return gone  # gone, or unstamped: left to the purge, as before
                entry = keys.replay_due(replay_hour(at), source, content_digest)
                with contextlib.suppress(ObjectExists):  # written by its request already
                    await self.store.put_if_absent(entry, b"", durable=False)
                return 0

        report.objects += sum(await asyncio.gather(*(one(k) for k in page.keys)))
        self._replay_cursor = page.next_token
        if page.next_token is None:
            await self.store.put(keys.REPLAYS_LISTED, b"")
            self._replays_indexed = True

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
            # The header first: a session that ended on the cutoff's day, after the
            # cutoff, is visited by every sweep that day, and needs nothing more.
            header = await self.snapshots.header(session_id)
            if not header.state.terminal:  # a stale marker; the session is not ended
                await self.store.delete(marker)
                return
            if header.updated_at > cutoff:
                await self._refile(marker, session_id, header.updated_at)
                report.kept += 1
                return
            # As stored, without its history chunks: what judges it is all in there.
            snapshot, etag = await self.snapshots.load_stored_tagged(session_id)
        except SessionNotFound:  # an earlier sweep got as far as the snapshot
            objects, tenant = await self._after_snapshot(session_id, marker, now, windows)
            report.objects += objects
            if tenant is not None:  # its index entry may have outlived that sweep
                report.forget.append((tenant, session_id))
            return
        except SnapshotError:  # corrupt, or a newer torpor's (mid-upgrade: it judges)
            report.kept += 1  # never delete what cannot be read: an operator looks first
            return
        if not snapshot.terminal or snapshot.updated_at > cutoff:
            report.kept += 1  # changed since its header was read: the next visit judges
            return
        born_ms = session_id_ms(session_id)
        young = born_ms is not None and born_ms > (now - windows).timestamp() * 1000
        if young:  # only with a period shorter than the windows (a tolerance past 8 h)
            report.kept += 1
            return
        doomed = await self._records(snapshot, now - windows, cutoff)
        if doomed is None:
            report.kept += 1
            return
        if not await self._delete_deliveries(doomed.deliveries):
            report.kept += 1  # resent meanwhile: the next visit finds it pending
            return
        await self._delete(doomed.records)
        await self._delete_pointers(doomed.pointers)
        await self._delete(doomed.deciding)
        await self._delete(doomed.finders)
        # The tenant into the ended marker before the snapshot goes: the index entry is
        # dropped after this pass (``Sweeper._retention``), and a kill before that left
        # it for ever unless a later visit, which finds no snapshot, can name it again.
        await self.store.put(marker, _note(snapshot.tenant, None))
        # Only the snapshot judged: an operator's resend of a dead letter commits the
        # ended session again (its outbox entry back to PENDING, to be sent) while the
        # purge ran, and a blind delete took it, answered as done, with the session. The
        # session stays; the next visit judges it as it is now (a recent change: kept).
        if not await self.store.delete_if_match(keys.snapshot(session_id), etag=etag):
            report.kept += 1
            return
        chunks, _ = await self._after_snapshot(session_id, marker, now, windows)
        report.objects += len(doomed) + chunks + 1
        report.purged.append((snapshot.tenant, session_id))

    async def _refile(self, marker: str, session_id: str, updated_at: datetime) -> None:
        """A session changed after it ended (e.g. its outbox settled): its marker filed
        under that day. Left alone when it is already: rewritten, it cost a (flushed)
        write at every sweep until the cutoff passed."""
        filed = keys.ended(ended_day(updated_at), session_id)
        if marker == filed:
            return
        await self.snapshots.mark_ended(session_id, updated_at)
        await self.store.delete(marker)

    async def _after_snapshot(
        self, session_id: str, marker: str, now: datetime, windows: timedelta
    ) -> tuple[int, str | None]:
        """What goes after the snapshot: its history chunks (until the snapshot is gone
        a late webhook may still activate the session, whose load needs them: without
        them it read as corrupt and was quarantined, and a quarantined session is not
        ended, so the purge never finished), late inbox events, its live marker, then the
        ended marker a retry after a crash finds all of this through, once it is
        ``windows`` old (``_settled``). The objects deleted, and the session's tenant if
        the marker names it."""
        chunks = await self._list(keys.chunk_prefix(session_id))
        await self._delete(chunks)
        late = await self._late_events(session_id, now - windows)
        await self.store.delete(keys.live(session_id))
        settled, tenant = await self._settled(marker, now, windows)
        if not settled:
            return len(chunks) + late, tenant
        await self.store.delete(marker)
        return len(chunks) + late + 1, tenant

    async def _settled(
        self, marker: str, now: datetime, windows: timedelta
    ) -> tuple[bool, str | None]:
        """Whether the ended marker may go: its session's snapshot went ``windows`` ago.
        A callback that found the session before the purge (its correlation record, its
        header) stores its event and replay marker after that, at any time its request
        takes: one stored after ``_late_events`` looked was named by nothing once the
        marker went. So the marker stays a window, stamped with when the snapshot was
        found gone, and each visit meanwhile looks for late events again."""
        tenant, gone_at = _noted(await self._data(marker) or b"")
        if gone_at is None:  # the snapshot went just now (or before a crash): stamp it
            await self.store.put(marker, _note(tenant, now))
            return False, tenant
        return now - gone_at >= windows, tenant

    async def _late_events(self, session_id: str, window_start: datetime) -> int:
        """Inbox events (and their replay markers) written after the inbox was listed: a
        resent callback routed through a correlation record before that went. Nothing
        would find them once the snapshot and the markers are gone.

        A marker stamped after ``window_start`` stays: its request was signed moments
        ago, and a captured copy replayed within the signature's tolerance gets past the
        index's claim (a held claim is no replay without the marker), so, addressed by
        business key alone, it could answer a newer wait that took the key. Named by no
        event now, it goes by its own stamp (``_sweep_replays``), as a resent
        duplicate's does: it is listed by its hour here, before its event goes."""
        found = await self._list(keys.inbox_prefix(session_id))
        replays: list[str] = []
        for event_key in found:
            event = await self._read(event_key, InboxEvent)
            if event is None or not event.content_digest:
                continue
            replay = keys.accepted_content(event.source, event.content_digest)
            try:
                at = await self._stored_time(replay)
            except ValueError:
                at = None  # unstamped (before stamps): nothing else would delete it
            if at is None or at.tzinfo is None or at <= window_start:
                replays.append(replay)
            else:
                entry = keys.replay_due(replay_hour(at), event.source, event.content_digest)
                with contextlib.suppress(ObjectExists):
                    await self.store.put_if_absent(entry, b"", durable=False)
        await self._delete(replays)
        await self._delete(found)
        return len(found) + len(replays)

    async def _records(
        self, snapshot: SessionSnapshot, window_start: datetime, cutoff: datetime
    ) -> Doomed | None:
        """Every object of the session but its snapshot, or None if one is still needed."""
        session_id = snapshot.session_id
        doomed = Doomed()
        answered: set[str] = set()  # correlation ids of the events in its inbox
        for event_key in await self._list(keys.inbox_prefix(session_id)):
            doomed.finders.append(event_key)
            event = await self._read(event_key, InboxEvent)
            if event is None:
                continue
            if event.received_at > window_start:
                return None  # its replay marker still guards the replay window
            if event.content_digest:
                doomed.records.append(keys.accepted_content(event.source, event.content_digest))
            if event.correlation_id:
                answered.add(event.correlation_id)
        referenced: set[str] = set()
        delivered: set[str] = set()
        works: set[str] = set()
        refs = keys.refs_prefix(session_id)
        for ref in await self._list(refs):
            doomed.finders.append(ref)
            kind, _, rest = ref.removeprefix(refs).partition("/")
            if kind == "c":
                referenced.add(rest)
                doomed.deciding.append(keys.correlation(rest))
                pointer = await self._data(ref)
                if pointer:  # goes only if the business key still names ours then
                    doomed.pointers.setdefault(pointer.decode(), set()).add(rest)
            elif kind == "d":
                tenant, _, delivery_id = rest.partition("/")
                delivered.add(delivery_id)
                if not await self._settled_delivery(tenant, delivery_id, doomed):
                    return None  # still being attempted
                doomed.records.append(keys.dead_letter(tenant, delivery_id))
                doomed.records.append(keys.pending_delivery(tenant, delivery_id))
            elif kind == "w":
                works.add(rest)
            elif kind == "i":
                tenant, _, hashed = rest.partition("/")
                record = keys.submit_key(tenant, hashed)
                if await self._names(record, session_id):  # not the key's later session's
                    doomed.records.append(record)
        await self._unreferenced(snapshot, referenced, answered, doomed)
        if not await self._unreferenced_deliveries(snapshot, delivered, doomed):
            return None
        for work in sorted(works):
            found = await self._list(keys.work_prefix(work))
            if not await self._work_over(work, found, cutoff):
                return None
            decided = {keys.work_outcome(work), keys.work_stopped(work)}
            doomed.records += [k for k in found if k not in decided]
            doomed.deciding += [k for k in found if k in decided]
        doomed.deciding += _stopped_without_order(snapshot, works)
        doomed.records += await self._list(keys.progress_prefix(session_id))
        return doomed

    async def _unreferenced(
        self, snapshot: SessionSnapshot, referenced: set[str], answered: set[str], doomed: Doomed
    ) -> None:
        """Correlation records and business-key pointers that no ref names: a session
        stored by 0.2 wrote them without refs. Its snapshot still names its waits' ids (the
        outbox's START and COMPENSATE entries, the 32 settled ones it keeps, and any wait
        still open) and its business keys; its inbox names the answered waits' ids. A
        record goes only if it names this session, a pointer only if it names one of ours:
        a later session may hold the same business key by now. A wait that was never
        answered and whose entry the outbox dropped cannot be found: its record stays."""
        sid = snapshot.session_id
        ours = {e.correlation_id for e in snapshot.outbox if e.correlation_id}
        ours |= {w.correlation_id for w in snapshot.waits}
        ours |= {m.correlation_id for group in snapshot.fan_ins for m in group.members}
        mine = set(referenced)
        for cid in sorted((ours | answered) - referenced):
            if await self._names_session(cid, sid):
                mine.add(cid)
                doomed.deciding.append(keys.correlation(cid))
        for business_key in snapshot.business_keys:
            pointer = keys.business_key(snapshot.tenant, business_key)
            named = await self._data(pointer)
            if named is None:
                continue
            cid = named.decode(errors="replace")
            if cid in mine or cid in ours:
                doomed.pointers.setdefault(pointer, set()).add(cid)
            elif await self._names_session(cid, sid):  # a wait the outbox no longer names
                doomed.pointers.setdefault(pointer, set()).add(cid)
                doomed.deciding.append(keys.correlation(cid))

    async def _unreferenced_deliveries(
        self, snapshot: SessionSnapshot, delivered: set[str], doomed: Doomed
    ) -> bool:
        """Deliveries no ref names (0.2 wrote none), found through the snapshot's NOTIFY
        entries (the terminal one is the newest, so the outbox keeps it); False while one
        is still being attempted."""
        for entry in snapshot.outbox:
            if entry.kind is not OutboxKind.NOTIFY:
                continue
            delivery_id = delivery_id_for(entry.idempotency_key)
            if delivery_id in delivered:
                continue
            key = keys.delivery(snapshot.tenant, delivery_id)
            found = await self._stored(key)
            delivery = None if found is None else _parsed(found.data, Delivery)
            if found is None or delivery is None or delivery.session_id != snapshot.session_id:
                continue
            if delivery.status is DeliveryStatus.PENDING:
                return False
            doomed.deliveries[key] = found.etag
            doomed.records.append(keys.dead_letter(snapshot.tenant, delivery_id))
            doomed.records.append(keys.pending_delivery(snapshot.tenant, delivery_id))
        return True

    async def _settled_delivery(self, tenant: str, delivery_id: str, doomed: Doomed) -> bool:
        """Whether a delivery is no longer being attempted; if it is stored, noted with
        its etag to go."""
        key = keys.delivery(tenant, delivery_id)
        found = await self._stored(key)
        if found is None:
            return True
        delivery = _parsed(found.data, Delivery)
        if delivery is not None and delivery.status is DeliveryStatus.PENDING:
            return False
        doomed.deliveries[key] = found.etag
        return True

    async def _delete_deliveries(self, deliveries: dict[str, str]) -> bool:
        """Delete each delivery if it is still as judged; False if one changed (and
        stays). An operator's resend of a dead letter turns it PENDING, by a
        compare-and-swap, and sets its timer: landing while the purge ran, the delivery
        was deleted blind, the resend answered as done and nothing ever sent. A delivery
        already gone (a purge that crashed after it) is no change."""
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str, etag: str) -> bool:
            async with gate:
                return await self.store.delete_if_match(key, etag=etag) or not await exists(
                    self.store, key
                )

        found = await asyncio.gather(*(one(k, e) for k, e in deliveries.items()))
        return all(found)

    async def _names(self, submit_key: str, session_id: str) -> bool:
        data = await self._data(submit_key)
        if data is None:
            return False
        try:
            return submit_keys.decode(data).session_id == session_id
        except (ValueError, KeyError, TypeError, InvalidKey):
            return False  # unreadable: left for an operator, as other records are

    async def _names_session(self, correlation_id: str, session_id: str) -> bool:
        try:
            key = keys.correlation(correlation_id)
        except InvalidKey:
            return False
        binding = await self._read(key, WaitBinding)
        return binding is not None and binding.session_id == session_id

    async def _work_over(self, work: str, found: list[str], cutoff: datetime) -> bool:
        """Whether a work's records may go: it recorded an outcome, or was stopped (a
        cancel, timeout or drift compensates the session's open waits, which stops it), or
        never got as far as its order. An ended session may still have work running
        without either: it failed (agent error, guard block) with a work wait open, which
        nothing compensates. Deleting its records then would let the watcher write an
        outcome and an inbox event for a session that is gone, so the session is kept
        until the work's own deadline is a whole retention period in the past: a watcher
        still alive by then is lost in all but name, and the records must not live
        forever."""
        if keys.work_outcome(work) in found or keys.work_stopped(work) in found:
            return True
        if keys.work_order(work) not in found:
            return True  # a ref whose order was never written, or a purge that crashed
        data = await self._data(keys.work_order(work))
        if data is None:
            return True
        try:
            order = WorkOrder.from_data(json.loads(data))
        except (ValueError, TypeError, KeyError):
            return False  # never delete what cannot be read: an operator looks first
        return order.deadline <= cutoff

    async def _delete_pointers(self, pointers: dict[str, set[str]]) -> None:
        """Delete each business-key pointer that still names its correlation id. The key
        is free since the session's waits closed: another session's new wait may take it
        at any time, and its pointer (what routes a webhook by business key after an
        index miss, and what repair mends the key's index entry from) replaces ours.
        Judged when the purge began and deleted blind, that pointer went. Each is read
        again right before its delete, and the delete is conditional on the etag read:
        a take between the two replaced the object (it names another correlation id,
        so its etag differs), and the delete refuses."""
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(pointer: str, ours: set[str]) -> None:
            async with gate:
                found = await self._stored(pointer)
                if found is not None and found.data.decode(errors="replace") in ours:
                    await self.store.delete_if_match(pointer, etag=found.etag)

        await asyncio.gather(*(one(p, ids) for p, ids in pointers.items()))

    async def _delete(self, doomed: list[str]) -> None:
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str) -> None:
            async with gate:
                await self.store.delete(key)

        await asyncio.gather(*(one(k) for k in doomed))

    async def _list(self, prefix: str) -> list[str]:
        return await all_keys(self.store, prefix)

    async def _data(self, key: str) -> bytes | None:
        found = await self._stored(key)
        return None if found is None else found.data

    async def _stored(self, key: str) -> StoredObject | None:
        try:
            return await self.store.get(keys.check_object_key(key))
        except ObjectNotFound:
            return None

    async def _stored_time(self, key: str) -> datetime | None:
        """The time ``key`` holds (ISO 8601), None if it is gone; ValueError if it holds
        none (the accept notes and the ended markers of purged sessions are stamped)."""
        data = await self._data(key)
        return None if data is None else datetime.fromisoformat(data.decode())

    async def _read(self, key: str, model: type[T]) -> T | None:
        data = await self._data(key)
        return None if data is None else _parsed(data, model)


def _stamp(data: bytes) -> datetime | None:
    """A replay marker's stamp; None for one with none (b"accepted", written before
    stamps), or not ours to judge. Ours are aware (the index's clock): a naive one does
    not compare."""
    try:
        at = datetime.fromisoformat(data.decode())
    except ValueError:
        return None
    return at if at.tzinfo is not None else None


def _parsed(data: bytes, model: type[T]) -> T | None:
    try:
        return model.model_validate_json(data)
    except ValidationError:
        return None


def _stopped_without_order(snapshot: SessionSnapshot, works: set[str]) -> list[str]:
    """Stop markers of work that no ref names: a cancel can stop work whose start never
    got as far as its order (and ref). Only a COMPENSATE entry still names that work; its
    id, a digest of a key holding this session's id, is no other session's."""
    stopped: list[str] = []
    for entry in snapshot.outbox:
        if entry.kind is not OutboxKind.COMPENSATE:
            continue
        work = work_id(entry.idempotency_key.removesuffix(COMPENSATE_SUFFIX))
        if work not in works:
            stopped.append(keys.work_stopped(work))
    return stopped


def _note(tenant: str | None, gone_at: datetime | None) -> bytes:
    """An ended marker's content once its purge reaches the snapshot: the session's
    tenant (what its index entry is forgotten by) and when the snapshot was found gone."""
    return json.dumps({"tenant": tenant, "gone_at": gone_at and gone_at.isoformat()}).encode()


def _noted(data: bytes) -> tuple[str | None, datetime | None]:
    """(tenant, gone at) of an ended marker: neither while it is empty (its session not
    purged) or unreadable; a bare time, as markers were stamped before tenants were
    noted, names no tenant."""
    try:
        text = data.decode()
        if not text.startswith("{"):
            return None, datetime.fromisoformat(text) if text else None
        note = json.loads(text)
        tenant, at = note.get("tenant"), note.get("gone_at")
        return (
            tenant if isinstance(tenant, str) else None,
            datetime.fromisoformat(at) if isinstance(at, str) else None,
        )
    except (ValueError, AttributeError):
        return None, None
