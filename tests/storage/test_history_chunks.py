"""Bounded snapshots: a long session's oldest history lives in immutable chunks beside
its snapshot, every commit writes a bounded amount, and nothing is lost or half-visible."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from storage.inbox import ObjectInbox
from storage.memory_store import MemoryObjectStore
from storage.snapshots import ObjectSnapshots
from tests.support.factories import NOW, snapshot
from torpor.errors import SessionNotFound, SnapshotCorrupt
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import Message, SessionHeader, SessionSnapshot, ToolLogEntry
from torpor.ports import StoredObject

STEPS = 1000


class Crash(Exception):
    """The process died at this write."""


class CrashingStore(MemoryObjectStore):
    """Memory store that dies once at the first write whose key contains ``at``."""

    def __init__(self) -> None:
        super().__init__()
        self.crash_at: str | None = None

    def _maybe_crash(self, key: str) -> None:
        if self.crash_at is not None and self.crash_at in key:
            self.crash_at = None
            raise Crash(key)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        self._maybe_crash(key)
        return await super().put_if_absent(key, data, durable=durable)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        self._maybe_crash(key)
        return await super().put_if_match(key, data, etag=etag)


def step(snap: SessionSnapshot, i: int) -> SessionSnapshot:
    """What one agent step appends: a tool call, its result, a log entry, an event id."""
    call_id = f"call_{i:05d}"
    entry = ToolLogEntry(
        key=f"k{i}",
        tool_name="extract",
        tool_call_id=call_id,
        step=i,
        result={"i": i},
        completed_at=NOW,
    )
    return snap.model_copy(
        update={
            "messages": [
                *snap.messages,
                Message(role="assistant", content=f"calling {i}"),
                Message(role="tool", tool_call_id=call_id, content=json.dumps({"i": i})),
            ],
            "tool_log": {**snap.tool_log, entry.key: entry},
            "processed_events": [*snap.processed_events, f"oa-evt-{i:06d}"],
            "step": i,
        }
    )


async def age(snapshots: ObjectSnapshots, snap: SessionSnapshot, steps: int) -> SessionSnapshot:
    for i in range(snap.step + 1, snap.step + steps + 1):
        snap = await snapshots.save(step(snap, i), expected_generation=snap.generation)
    return snap


async def test_a_thousand_step_session_reloads_whole_from_a_bounded_snapshot() -> None:
    store = MemoryObjectStore()
    snapshots = ObjectSnapshots(store)
    snap = await age(snapshots, await snapshots.create(snapshot()), STEPS)

    loaded = await ObjectSnapshots(store).load(snap.session_id)  # no cache: from storage
    assert loaded == snap
    assert len(loaded.messages) == 2 + 2 * STEPS
    assert loaded.messages[2].content == "calling 1"
    assert list(loaded.tool_log)[:2] == ["k1", "k2"]
    assert loaded.processed_events[0] == "oa-evt-000001"

    # The snapshot object itself holds only a bounded tail of each list.
    stored = (await store.get(keys.snapshot(snap.session_id))).data
    body = json.loads(zlib.decompress(stored[7 + struct.unpack(">H", stored[5:7])[0] :]))
    size = snap.chunks.size
    assert len(body["messages"]) < 2 * size
    assert len(body["tool_log"]) < 2 * size
    assert len(body["processed_events"]) < 2 * size


async def test_an_event_processed_a_thousand_steps_ago_is_still_a_duplicate() -> None:
    store = MemoryObjectStore()
    snapshots, inbox = ObjectSnapshots(store), ObjectInbox(store)
    snap = await snapshots.create(snapshot(state=SessionState.SUSPENDED))
    first = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=snap.session_id,
        source="oa",
        event_id="evt-first",
        type="oa.approval.decided",
        received_at=NOW,
    )
    assert await inbox.deliver(first)
    snap = await snapshots.save(
        snap.model_copy(update={"processed_events": [first.key]}), expected_generation=0
    )
    snap = await age(snapshots, snap, STEPS)
    assert first.key not in snap.processed_events[-2 * snap.chunks.size :]  # long sealed

    loaded = await ObjectSnapshots(store).load(snap.session_id)
    # The redelivered event is not applied again: the inbox refuses the copy, and the
    # original is not pending because the reloaded processed set still names it.
    assert not await inbox.deliver(first)
    assert await inbox.pending(snap.session_id, processed=set(loaded.processed_events)) == []


async def test_a_crash_after_the_chunk_before_the_snapshot_leaves_the_last_commit() -> None:
    store = CrashingStore()
    snapshots = ObjectSnapshots(store)
    snap = await age(snapshots, await snapshots.create(snapshot()), 62)
    chunks_before = len((await store.list(keys.chunk_prefix(snap.session_id))).keys)

    store.crash_at = keys.snapshot(snap.session_id)  # the chunk is written, the swap dies
    with pytest.raises(Crash):
        await snapshots.save(step(snap, 63), expected_generation=snap.generation)
    assert len((await store.list(keys.chunk_prefix(snap.session_id))).keys) > chunks_before

    reader = ObjectSnapshots(store)
    assert await reader.load(snap.session_id) == snap  # the orphan chunk is invisible
    # The next activation commits the same step: the orphan is that very chunk.
    redone = await reader.save(step(snap, 63), expected_generation=snap.generation)
    assert await ObjectSnapshots(store).load(snap.session_id) == redone


async def test_a_crash_writing_the_chunk_never_publishes_a_snapshot_that_names_it() -> None:
    store = CrashingStore()
    snapshots = ObjectSnapshots(store)
    snap = await age(snapshots, await snapshots.create(snapshot()), 62)

    store.crash_at = "/messages/"  # dies while sealing the first message chunk
    with pytest.raises(Crash):
        await snapshots.save(step(snap, 63), expected_generation=snap.generation)
    assert await ObjectSnapshots(store).load(snap.session_id) == snap


async def test_a_missing_chunk_is_reported_as_corruption_not_a_shorter_history() -> None:
    store = MemoryObjectStore()
    snapshots = ObjectSnapshots(store)
    snap = await age(snapshots, await snapshots.create(snapshot()), 200)
    first_chunk = (await store.list(keys.chunk_prefix(snap.session_id))).keys[0]
    await store.delete(first_chunk)
    with pytest.raises(SnapshotCorrupt, match="missing"):
        await ObjectSnapshots(store).load(snap.session_id)


class PurgedAfterRead(MemoryObjectStore):
    """Retention runs between a load's read of the snapshot and of its chunks: the
    snapshot goes first, then the chunks (``ObjectRetention._one``)."""

    def __init__(self) -> None:
        super().__init__()
        self.purge: str | None = None

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        found = await super().get(key, max_bytes=max_bytes)
        if self.purge is not None and key == keys.snapshot(self.purge):
            sid, self.purge = self.purge, None
            await self.delete(key)
            for chunk in (await self.list(keys.chunk_prefix(sid))).keys:
                await self.delete(chunk)
        return found


async def test_a_load_that_retention_overtakes_finds_the_session_gone_not_corrupt() -> None:
    store = PurgedAfterRead()
    snapshots = ObjectSnapshots(store)
    snap = await age(snapshots, await snapshots.create(snapshot()), 200)
    assert (await store.list(keys.chunk_prefix(snap.session_id))).keys
    store.purge = snap.session_id
    with pytest.raises(SessionNotFound):
        await ObjectSnapshots(store).load(snap.session_id)


async def test_a_snapshot_stored_before_chunks_existed_loads() -> None:
    store = MemoryObjectStore()
    old = step(step(snapshot(), 1), 2)
    document = json.loads(old.model_dump_json())
    del document["chunks"]  # what 0.1 wrote: schema 1, a header without trace or routes
    document["schema_version"] = 1
    header = (
        SessionHeader.of(old)
        .model_copy(update={"schema_version": 1, "trace_id": None, "waits": None})
        .model_dump_json(exclude_none=True)
        .encode()
    )
    data = struct.pack(">4sBH", b"TPS1", 1, len(header)) + header
    await store.put(
        keys.snapshot(old.session_id), data + zlib.compress(json.dumps(document).encode())
    )

    snapshots = ObjectSnapshots(store)
    loaded = await snapshots.load(old.session_id)
    assert loaded == old
    aged = await age(snapshots, loaded, 100)  # and keeps working, now in chunks
    assert await ObjectSnapshots(store).load(old.session_id) == aged
    assert SnapshotCodec().decode(data + zlib.compress(json.dumps(document).encode())) == old


@pytest.mark.parametrize("size", [0, -64])
async def test_a_snapshot_whose_chunk_size_is_not_positive_is_corrupt_not_a_hang(
    size: int,
) -> None:
    """``seal`` steps through a list ``size`` items at a time: a stored size of 0 or less
    (a damaged snapshot that still passes its checksum, or one written by hand) looped
    for ever in the first commit after the load, holding the lease by its heartbeat."""
    store = MemoryObjectStore()
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot())
    chunks = snap.chunks.model_copy(update={"size": size})  # unchecked, as damage is
    bad = snap.model_copy(update={"chunks": chunks})
    await store.put(keys.snapshot(snap.session_id), SnapshotCodec().encode(bad))
    with pytest.raises(SnapshotCorrupt):
        await ObjectSnapshots(store).load(snap.session_id)
