"""The purge of one ended session (``storage.retention``): judged by its header and
snapshot, its records deleted phase by phase (``storage.retention_records``), then the
snapshot (only as judged), its history chunks, late inbox events and live marker, and
its ended marker last, a window after the snapshot went."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import datetime, timedelta

from storage import keys
from storage.inbox import replay_hour
from storage.listing import exists
from storage.retention_records import SessionRecords
from storage.retention_state import DELETES_AT_ONCE
from storage.snapshots import ended_day
from torpor.errors import (
    ObjectExists,
    SessionNotFound,
    SnapshotError,
)
from torpor.events import InboxEvent
from torpor.ids import session_id_ms
from torpor.ports.repositories import RetentionReport


class SessionPurge(SessionRecords):
    """The purge of an ended session, visited through its ended marker."""

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
