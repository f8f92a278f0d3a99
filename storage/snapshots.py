"""Snapshots in the object store: create-only birth, compare-and-swap on every commit.

One object per session (``snapshots/{session_id}``). ``save`` writes generation N+1 only
if the stored object is still generation N, using the etag as the S3 ``If-Match``
condition: the etag read together with generation N is remembered, so the common case
is one conditional PUT; otherwise the current object is read first to learn its etag.

A long session's oldest messages, tool-log entries and processed event ids are sealed
into immutable chunk objects first (``storage/chunks.py``), so what a commit writes stays
bounded however old the session is; ``load`` puts them back in front.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from storage import chunks, keys
from storage.codec import HEADER_READ_BYTES, SnapshotCodec
from storage.listing import exists
from torpor.errors import (
    CommitConflict,
    EtagMismatch,
    ObjectNotFound,
    SessionNotFound,
    SnapshotCorrupt,
    SnapshotError,
)
from torpor.ids import session_id_ms
from torpor.lifecycle import SessionState
from torpor.models import SessionHeader, SessionSnapshot, WaitingSession
from torpor.ports import MovesObjects, ObjectStore, Staged, StagesReplaces, WalksObjects

ETAG_CACHE_SIZE = 4096
Live = TypeVar("Live", SessionHeader, WaitingSession)
# A live marker with no snapshot this long after its session id was made is a create
# that failed, not one still under way.
STALE_MARKER = timedelta(hours=1)


def ended_day(at: datetime) -> str:
    """The day an ended marker is filed under (``YYYYMMDD``, UTC)."""
    return at.astimezone(UTC).strftime("%Y%m%d")


class ObjectSnapshots:
    def __init__(self, store: ObjectStore, codec: SnapshotCodec | None = None) -> None:
        self.store = store
        self.codec = codec or SnapshotCodec()
        # What the store can do, asked once, as the inbox does: an ``isinstance`` against
        # a runtime-checkable protocol walks its members each time (some 230 interpreted
        # instructions, twice in a session's last commit).
        self._stages = store if isinstance(store, StagesReplaces) else None
        self._moves = store if isinstance(store, MovesObjects) else None
        # session id → (generation, etag, state) of the last object read or written
        self._etags: OrderedDict[str, tuple[int, str, SessionState]] = OrderedDict()
        self._markers_complete = False

    def _remember(self, session_id: str, generation: int, etag: str, state: SessionState) -> None:
        self._etags[session_id] = (generation, etag, state)
        self._etags.move_to_end(session_id)
        while len(self._etags) > ETAG_CACHE_SIZE:
            self._etags.popitem(last=False)

    def release(self, session_id: str) -> None:
        # Every activation starts with a load, which refills this: a sleeping session
        # leaves nothing behind in a long-lived host.
        self._etags.pop(session_id, None)

    async def create(self, snapshot: SessionSnapshot) -> SessionSnapshot:
        first, stored, sealed = chunks.seal(snapshot.model_copy(update={"generation": 0}))
        # The live marker before the snapshot: a session repair cannot find never exists.
        # One left by a create that failed names no snapshot; repair drops it.
        await self.store.put(keys.live(first.session_id), b"")
        await chunks.write(self.store, sealed)
        etag = await self.store.put_if_absent(
            keys.snapshot(first.session_id), self.codec.encode(stored)
        )
        self._remember(first.session_id, 0, etag, first.state)
        return first

    async def load(self, session_id: str) -> SessionSnapshot:
        snapshot, etag = await self._restored(session_id, chunks.KINDS)
        self._remember(session_id, snapshot.generation, etag, snapshot.state)
        return snapshot

    async def processed_events(self, session_id: str) -> list[str]:
        """Every event id the session processed, its sealed ones too: only those chunks
        are read, not its conversation's and tool log's (most of a long session)."""
        snapshot, _ = await self._restored(session_id, ("processed_events",))
        return snapshot.processed_events

    async def _restored(
        self, session_id: str, kinds: tuple[str, ...]
    ) -> tuple[SessionSnapshot, str]:
        key = keys.snapshot(session_id)
        try:
            obj = await self.store.get(key)
        except ObjectNotFound:
            raise SessionNotFound(f"no session {session_id}", session_id=session_id) from None
        stored = self.codec.decode(obj.data, what=f"snapshot of {session_id}")
        try:
            return await chunks.restore(self.store, stored, kinds=kinds), obj.etag
        except SnapshotCorrupt:
            # Retention deletes the snapshot, then its chunks: read in between, the
            # session is gone, not damaged.
            if not await exists(self.store, key):
                raise SessionNotFound(f"no session {session_id}", session_id=session_id) from None
            raise

    async def load_waiting(self, session_id: str) -> WaitingSession:
        try:
            obj = await self.store.get(keys.snapshot(session_id))
        except ObjectNotFound:
            raise SessionNotFound(f"no session {session_id}", session_id=session_id) from None
        return self.codec.decode_waiting(obj.data, what=f"snapshot of {session_id}")

    async def load_stored(self, session_id: str) -> SessionSnapshot:
        """The snapshot as stored, its sealed history chunks left out."""
        snapshot, _ = await self.load_stored_tagged(session_id)
        return snapshot

    async def load_stored_tagged(self, session_id: str) -> tuple[SessionSnapshot, str]:
        """``load_stored`` and the etag read with it (what retention reads: it needs no
        chunk, deletes them after the snapshot, and the snapshot only if it is still the
        one it judged)."""
        try:
            obj = await self.store.get(keys.snapshot(session_id))
        except ObjectNotFound:
            raise SessionNotFound(f"no session {session_id}", session_id=session_id) from None
        return self.codec.decode(obj.data, what=f"snapshot of {session_id}"), obj.etag

    async def save(self, snapshot: SessionSnapshot, *, expected_generation: int) -> SessionSnapshot:
        sid = snapshot.session_id
        key = keys.snapshot(sid)
        cached = self._etags.get(sid)
        if cached is not None and cached[0] == expected_generation:
            etag, before = cached[1], cached[2]
        else:
            try:
                current = await self.store.get(key)
            except ObjectNotFound:
                raise SessionNotFound(f"no session {sid}", session_id=sid) from None
            header = self.codec.decode_header(current.data, what=f"snapshot of {sid}")
            if header.generation != expected_generation:
                raise CommitConflict(
                    f"session {sid} is at generation {header.generation}, "
                    f"not {expected_generation}",
                    session_id=sid,
                )
            etag, before = current.etag, header.state
        new, stored, sealed = chunks.seal(
            snapshot.model_copy(update={"generation": expected_generation + 1})
        )
        # Chunks before the snapshot that names them: a crash in between leaves only an
        # orphan chunk nobody reads, never a snapshot naming a chunk that is not there.
        await chunks.write(self.store, sealed)
        data, ending = self.codec.encode(stored), new.state.terminal and not before.terminal
        # A session's last commit: its snapshot staged, then its marker moved, one flush
        # of the disk for both (the move's, which covers the snapshot's change, logged
        # before it): a webhook whose resume ends its session made four flushes, now
        # three (counted, README). The ended marker is written only once the terminal
        # snapshot is logged, and the live one goes only with a flush that covers both
        # (``after``: a snapshot another writer's failed flush lost fails the move): a
        # terminal snapshot the log lost keeps its live marker, and the ended one a
        # power cut may leave beside it is passed over by ``list_ended`` and removed by
        # retention (both read the snapshot's state, not the marker).
        staged = None
        try:
            if ending and self._stages is not None:
                staged = await self._stages.stage_if_match(key, data, etag=etag)
                new_etag = staged.etag
            else:
                new_etag = await self.store.put_if_match(key, data, etag=etag)
        except EtagMismatch:
            self._etags.pop(sid, None)
            raise CommitConflict(
                f"session {sid} changed since generation {expected_generation}", session_id=sid
            ) from None
        try:
            if ending:
                await self.mark_ended(new.session_id, new.updated_at, after=staged)
        finally:
            if staged is not None:
                # At once when the move flushed; else (it failed) this flush makes the
                # snapshot durable before the commit is reported, either way.
                await staged.durable()
            self._remember(sid, new.generation, new_etag, new.state)
        return new

    async def mark_ended(
        self, session_id: str, at: datetime, *, after: Staged | None = None
    ) -> None:
        """Move the session from the live markers to the ended ones (idempotent). A crash
        before it leaves a live marker on an ended session: repair finishes the move.
        ``after``: the staged terminal snapshot, which the live marker must not outlive
        (``MovesObjects.move``)."""
        ended, live = keys.ended(ended_day(at), session_id), keys.live(session_id)
        if self._moves is not None:
            # The marker renamed, one flush: a put and a delete in a row, two flushes,
            # were a third of a session's final commit on the local folder (README).
            if not await self._moves.move(live, ended, after=after):
                await self.store.put(ended, b"")  # no live marker (moved already)
            return
        await self.store.put(ended, b"")
        if after is not None:
            await after.durable()
        await self.store.delete(live)

    async def list_live(
        self, *, now: datetime, concurrency: int = 16
    ) -> AsyncIterator[SessionHeader]:
        """Headers of the sessions that have not ended, read through the live markers:
        the cost follows the live sessions, not every session the store ever held.

        Markers are tidied on the way: one whose session ended gets its move finished,
        one whose snapshot never came (a create that failed) is dropped once the create
        is long over. The first call on a store written before markers existed lists
        every snapshot once to write them."""
        async for header in self._live(self.header, now, concurrency, or_header=False):
            yield header

    async def list_live_waiting(
        self, *, now: datetime, concurrency: int = 16
    ) -> AsyncIterator[WaitingSession | SessionHeader]:
        """As ``list_live``, each session read once, whole (``load_waiting``): repair needs
        the waits of nearly every one, and read a ranged header and then the whole object
        (two requests a session to S3). A session whose body cannot be read comes as its
        header, for the reader to report when it loads it."""
        async for session in self._live(self.load_waiting, now, concurrency, or_header=True):
            yield session

    async def _live(
        self,
        read: Callable[[str], Awaitable[Live]],
        now: datetime,
        concurrency: int,
        *,
        or_header: bool,
    ) -> AsyncIterator[Live | SessionHeader]:
        await self._backfill_markers()
        gate = asyncio.Semaphore(concurrency)

        async def one(sid: str) -> Live | SessionHeader | None:
            async with gate:
                try:
                    found: Live | SessionHeader = await read(sid)
                except SessionNotFound:
                    born = session_id_ms(sid)
                    if born is None or born < (now - STALE_MARKER).timestamp() * 1000:
                        await self.store.delete(keys.live(sid))
                    return None
                except SnapshotError:  # unreadable, or a newer torpor's: not ours to judge
                    if not or_header:
                        return None  # ``load`` reports it loudly
                    try:
                        found = await self.header(sid)
                    except (SessionNotFound, SnapshotError):
                        return None
            if found.state.terminal:
                await self._finish_ending(sid, found.updated_at)
                return None
            return found

        async for page in self._pages(keys.LIVE, 1000):
            ids = [k.removeprefix(keys.LIVE) for k in page]
            for found in await asyncio.gather(*(one(sid) for sid in ids)):
                if found is not None:
                    yield found

    async def _finish_ending(self, sid: str, at: datetime) -> None:
        """The move of an ended session's live marker that its last commit did not finish
        (a crash). On a store that stages, the terminal snapshot is written again first
        (the same bytes: one more record in its log) and the move rests on it: if the log
        lost the snapshot's own record (a flush that failed, in this boot), its file may
        be on disk as it was before, and the live marker must not go before it is."""
        if self._stages is None:
            await self.mark_ended(sid, at)
            return
        key = keys.snapshot(sid)
        try:
            current = await self.store.get(key)
            staged = await self._stages.stage_if_match(key, current.data, etag=current.etag)
        except (ObjectNotFound, EtagMismatch):
            return  # changed or gone meanwhile: its writer or the next walk moves it
        try:
            await self.mark_ended(sid, at, after=staged)
        finally:
            await staged.durable()

    async def list_ended(self, *, since: datetime, now: datetime) -> AsyncIterator[SessionHeader]:
        """Headers of the sessions that ended on the days from ``since`` to ``now``."""
        await self._backfill_markers()
        day = since
        while ended_day(day) <= ended_day(now):
            async for page in self._pages(f"{keys.ENDED}{ended_day(day)}/", 1000):
                for key in page:
                    try:
                        header = await self.header(key.rsplit("/", 1)[-1])
                    except (SessionNotFound, SnapshotError):
                        continue
                    # A power cut can leave an ended marker beside a live one on a
                    # snapshot whose terminal commit the log lost (``save``): the
                    # session is live, and ``list_live`` has it.
                    if header.state.terminal:
                        yield header
            day += timedelta(days=1)

    async def _backfill_markers(self) -> None:
        if self._markers_complete:
            return
        try:
            await self.store.get(keys.MARKERS_COMPLETE, max_bytes=1)
        except ObjectNotFound:
            async for header in self.list_by_state():
                if header.state.terminal:
                    await self.store.put(
                        keys.ended(ended_day(header.updated_at), header.session_id), b""
                    )
                else:
                    await self.store.put(keys.live(header.session_id), b"")
            await self.store.put(keys.MARKERS_COMPLETE, b"")
        self._markers_complete = True

    async def _pages(self, prefix: str, page_size: int) -> AsyncIterator[list[str]]:
        """The markers under ``prefix``, a page at a time: walked (``WalksObjects``) where
        the store can, so that a walk of a million live markers lists their folder once."""
        store = self.store
        pages = store.walk if isinstance(store, WalksObjects) else store.list
        token: str | None = None
        while True:
            page = await pages(prefix, start_after=token, limit=page_size)
            if page.keys:
                yield page.keys
            if page.next_token is None:
                return
            token = page.next_token

    async def header(self, session_id: str) -> SessionHeader:
        key = keys.snapshot(session_id)
        try:
            obj = await self.store.get(key, max_bytes=HEADER_READ_BYTES)
            if (end := self.codec.header_end(obj.data)) > len(obj.data) == HEADER_READ_BYTES:
                obj = await self.store.get(key, max_bytes=end)  # a longer header
        except ObjectNotFound:
            raise SessionNotFound(f"no session {session_id}", session_id=session_id) from None
        return self.codec.decode_header(obj.data, what=f"snapshot of {session_id}")

    async def session_ids(self, *, page_size: int = 1000) -> AsyncIterator[list[str]]:
        token: str | None = None
        while True:
            page = await self.store.list(keys.SNAPSHOTS, start_after=token, limit=page_size)
            if page.keys:
                yield [keys.session_id_of_snapshot(k) for k in page.keys]
            if page.next_token is None:
                return
            token = page.next_token

    async def list_by_state(
        self, states: Collection[SessionState] | None = None, *, concurrency: int = 16
    ) -> AsyncIterator[SessionHeader]:
        """Headers of every session (optionally only in ``states``), read with ranged
        GETs. Unreadable snapshots are skipped here; ``load`` reports them loudly."""
        gate = asyncio.Semaphore(concurrency)

        async def one(sid: str) -> SessionHeader | None:
            async with gate:
                try:
                    return await self.header(sid)
                except (SessionNotFound, SnapshotError):
                    return None

        async for ids in self.session_ids():
            for header in await asyncio.gather(*(one(sid) for sid in ids)):
                if header is not None and (states is None or header.state in states):
                    yield header
