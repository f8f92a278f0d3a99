"""Snapshots, inbox, correlation records, batches and deliveries, on the local folder
and on S3."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import timedelta

import pyarrow.parquet as pq
import pytest

from storage import keys
from storage.batches import GENERATION_READS_AT_ONCE, ObjectBatches
from storage.correlations import ObjectCorrelations
from storage.deliveries import SCAN_MAX, ObjectDeliveries
from storage.inbox import ObjectInbox
from storage.memory_store import MemoryObjectStore
from storage.snapshots import ObjectSnapshots, ended_day
from tests.support.factories import NOW, busy_snapshot, snapshot
from tests.support.harness import keys_read
from torpor.batches import BatchManifest, FanOutCursor, ResultLine, RetryGeneration
from torpor.deliveries import Delivery, DeliveryStatus, EndpointState
from torpor.errors import (
    CommitConflict,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    SessionNotFound,
    SnapshotCorrupt,
    StorageUnavailable,
)
from torpor.events import EventKind, InboxEvent
from torpor.ids import new_correlation_id
from torpor.lifecycle import SessionState, transition
from torpor.ports import ObjectStore, StoredObject, WaitBinding


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    name = "local_store" if request.param == "local" else "s3_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


async def test_create_load_save_round_trip(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    first = await snapshots.create(snapshot())
    assert first.generation == 0
    running = transition(first, SessionState.RUNNING, now=NOW)
    saved = await snapshots.save(running, expected_generation=0)
    assert saved.generation == 1
    loaded = await ObjectSnapshots(store).load(first.session_id)  # a fresh store: no etag cache
    assert loaded == saved


async def test_an_ended_session_moves_from_the_live_markers_to_the_ended_ones(
    store: ObjectStore,
) -> None:
    snapshots = ObjectSnapshots(store)
    first = await snapshots.create(snapshot())
    sid = first.session_id
    assert (await store.list(keys.live(sid))).keys == [keys.live(sid)]
    running = await snapshots.save(
        transition(first, SessionState.RUNNING, now=NOW), expected_generation=0
    )
    done = await snapshots.save(
        transition(running, SessionState.COMPLETED, now=NOW), expected_generation=1
    )
    ended = keys.ended(ended_day(done.updated_at), sid)
    # The local folder renames the marker (one flush); S3 puts the new one, then deletes.
    assert (await store.list(keys.live(sid))).keys == []
    assert (await store.get(ended)).data == b""
    await snapshots.mark_ended(sid, done.updated_at)  # again (repair finishing a move)
    assert (await store.list(keys.live(sid))).keys == []
    assert (await store.get(ended)).data == b""


async def test_an_ended_marker_beside_a_live_session_is_not_listed_as_ended(
    store: ObjectStore,
) -> None:
    """What a power cut can leave when the log lost a terminal commit whose marker move
    was on disk already: both markers, a live snapshot. Repair lists it once, as live."""
    snapshots = ObjectSnapshots(store)
    first = await snapshots.create(snapshot())
    sid = first.session_id
    await store.put(keys.ended(ended_day(NOW), sid), b"")
    since = NOW - timedelta(days=1)
    assert [h.session_id async for h in snapshots.list_ended(since=since, now=NOW)] == []
    assert [h.session_id async for h in snapshots.list_live(now=NOW)] == [sid]


async def test_the_walk_for_repair_reads_each_live_session_whole_and_tidies_as_the_header_walk(
    store: ObjectStore,
) -> None:
    """``list_live_waiting``: the waits of each live session, from one read; a session
    that ended with its live marker left behind (a crash in its last commit) gets its
    move finished, as ``list_live`` does, and is not listed."""
    snapshots = ObjectSnapshots(store)
    waiting = await snapshots.create(busy_snapshot(4))
    ended = await snapshots.create(snapshot())
    await snapshots.save(transition(ended, SessionState.CANCELLED, now=NOW), expected_generation=0)
    await store.put(keys.live(ended.session_id), b"")  # as a crash mid-move leaves it
    found = [s async for s in snapshots.list_live_waiting(now=NOW)]
    assert [(s.session_id, s.waits) for s in found] == [(waiting.session_id, waiting.waits)]
    assert (await store.list(keys.live(ended.session_id))).keys == []


async def test_create_is_create_only(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot())
    with pytest.raises(ObjectExists):
        await snapshots.create(snap)


async def test_lost_race_raises_conflict_and_writes_nothing(store: ObjectStore) -> None:
    a, b = ObjectSnapshots(store), ObjectSnapshots(store)  # two activations, two processes
    created = await a.create(snapshot())
    base_a = await a.load(created.session_id)
    base_b = await b.load(created.session_id)
    winner = await a.save(transition(base_a, SessionState.RUNNING, now=NOW), expected_generation=0)
    with pytest.raises(CommitConflict):
        await b.save(transition(base_b, SessionState.CANCELLED, now=NOW), expected_generation=0)
    assert await ObjectSnapshots(store).load(created.session_id) == winner


async def test_ten_concurrent_commits_exactly_one_wins(store: ObjectStore) -> None:
    created = await ObjectSnapshots(store).create(snapshot())
    writers = [ObjectSnapshots(store) for _ in range(10)]
    bases = [await w.load(created.session_id) for w in writers]

    async def commit(i: int) -> bool:
        draft = bases[i].model_copy(update={"variables": {"writer": i}})
        try:
            await writers[i].save(draft, expected_generation=0)
        except CommitConflict:
            return False
        return True

    results = await asyncio.gather(*(commit(i) for i in range(10)))
    assert sum(results) == 1
    final = await ObjectSnapshots(store).load(created.session_id)
    assert final.generation == 1 and final.variables == {"writer": results.index(True)}


async def test_save_with_stale_expectation_conflicts_without_cache(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot())
    await snapshots.save(snap, expected_generation=0)
    with pytest.raises(CommitConflict, match="generation 1"):
        await ObjectSnapshots(store).save(snap, expected_generation=0)


async def test_missing_and_corrupt_snapshots_are_typed(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    with pytest.raises(SessionNotFound):
        await snapshots.load("s_nobody")
    await store.put(keys.snapshot("s_broken"), b"TPS1\x01\x00\x05{oops")
    with pytest.raises(SnapshotCorrupt, match="s_broken"):
        await snapshots.load("s_broken")


async def test_list_by_state_reads_headers(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    ids = {}
    for state in (SessionState.PENDING, SessionState.SUSPENDED, SessionState.SUSPENDED):
        snap = await snapshots.create(snapshot().model_copy(update={"state": state}))
        ids[snap.session_id] = state
    await store.put(keys.snapshot("s_garbage"), b"not a snapshot")
    found = [h async for h in snapshots.list_by_state({SessionState.SUSPENDED})]
    assert sorted(h.session_id for h in found) == sorted(
        sid for sid, st in ids.items() if st is SessionState.SUSPENDED
    )
    everything = [h async for h in snapshots.list_by_state()]
    assert len(everything) == 3


def event(session_id: str, event_id: str, *, seconds: float = 0) -> InboxEvent:
    return InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=session_id,
        source="oa",
        event_id=event_id,
        type="oa.approval.decided",
        received_at=NOW + timedelta(seconds=seconds),
        data={"status": "approved"},
    )


async def test_inbox_dedupes_and_orders(store: ObjectStore) -> None:
    inbox = ObjectInbox(store)
    assert await inbox.deliver(event("s_1", "e-2", seconds=2))
    assert await inbox.deliver(event("s_1", "e-1", seconds=1))
    assert not await inbox.deliver(event("s_1", "e-1", seconds=9))  # redelivery
    await inbox.deliver(event("s_2", "e-1"))
    pending = await inbox.pending("s_1", processed=set())
    assert [e.event_id for e in pending] == ["e-1", "e-2"]
    assert pending[0].received_at == NOW + timedelta(seconds=1)  # the first delivery stands
    rest = await inbox.pending("s_1", processed={pending[0].key})
    assert [e.event_id for e in rest] == ["e-2"]


async def test_correlation_records_survive_as_source_of_truth(store: ObjectStore) -> None:
    records = ObjectCorrelations(store)
    binding = WaitBinding(
        tenant="acme",
        correlation_id=new_correlation_id(),
        session_id="s_1",
        epoch=2,
        step_id="1",
        deadline=NOW + timedelta(hours=1),
    )
    await records.record(binding, business_key="PO-7")
    await records.record(binding, business_key="PO-7")  # a re-bind after a crash is harmless
    assert await records.lookup(binding.correlation_id) == binding
    assert await records.lookup_business_key(tenant="acme", business_key="PO-7") == binding
    assert await records.lookup_business_key(tenant="other", business_key="PO-7") is None
    assert await records.lookup(new_correlation_id()) is None


async def test_busy_snapshot_round_trips_through_storage(store: ObjectStore) -> None:
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(busy_snapshot())
    assert await ObjectSnapshots(store).load(snap.session_id) == snap


async def test_batch_manifests_are_create_only(store: ObjectStore) -> None:
    batches = ObjectBatches(store)
    manifest = BatchManifest(
        batch_id="b_1", tenant="acme", agent="purchase", session_ids=["s_1"], created_at=NOW
    )
    assert await batches.create(manifest)
    assert not await batches.create(manifest.model_copy(update={"session_ids": ["s_2"]}))
    assert await batches.get("b_1") == manifest
    await store.put(keys.batch("b_2"), b"not a manifest")
    for missing in ("b_404", "b_2", "../etc"):
        with pytest.raises(NotFound) as info:
            await batches.get(missing)
        assert not isinstance(info.value, SessionNotFound)


async def test_a_fan_out_cursor_only_moves_forward(store: ObjectStore) -> None:
    """Two fan-outs of one batch: the one behind never puts the cursor back over what the
    other finished (were it to die then, the cursor would stay short for ever)."""
    batches = ObjectBatches(store)
    assert await batches.cursor("b_1") == FanOutCursor()
    await batches.save_cursor("b_1", FanOutCursor(next=8))
    await batches.save_cursor("b_1", FanOutCursor(next=4))  # the one behind
    assert await batches.cursor("b_1") == FanOutCursor(next=8)
    # At once, as two fan-outs would: the furthest wins, whatever the order.
    await asyncio.gather(*(batches.save_cursor("b_1", FanOutCursor(next=n)) for n in (12, 9, 16)))
    assert await batches.cursor("b_1") == FanOutCursor(next=16)


async def test_a_batchs_retry_generations_are_read_side_by_side_in_order(
    store: ObjectStore,
) -> None:
    """Every look at a batch reads all its retry generations: one after the other, a batch
    retried a hundred times waited for a hundred store round trips in a row (seconds on
    S3) on every GET. They are read at once, up to a bound, and come back in order."""
    batches = ObjectBatches(store)
    made = [
        RetryGeneration(generation=g, documents=[g], created_at=NOW)
        for g in range(1, 2 * GENERATION_READS_AT_ONCE + 1)
    ]
    for generation in made:
        assert await batches.add_generation("b_1", generation)
    in_flight = peak = 0
    get = store.get

    async def counted(key: str, *, max_bytes: int | None = None) -> StoredObject:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0)  # a store read yields: the others may start meanwhile
            return await get(key, max_bytes=max_bytes)
        finally:
            in_flight -= 1

    store.get = counted  # type: ignore[method-assign]
    assert await batches.generations("b_1") == made
    assert peak == GENERATION_READS_AT_ONCE


async def test_a_batchs_retry_generations_are_counted_by_listing_none_read(
    store: ObjectStore,
) -> None:
    batches = ObjectBatches(store)
    assert await batches.generation_count("b_1") == 0
    for g in (1, 2, 3):
        made = RetryGeneration(generation=g, documents=[g], created_at=NOW)
        assert await batches.add_generation("b_1", made)
    await batches.add_generation(
        "b_10", RetryGeneration(generation=1, documents=[], created_at=NOW)
    )
    read = keys_read(store)
    assert await batches.generation_count("b_1") == 3
    assert read == []


async def test_a_batchs_document_ids_are_kept_once_beside_its_documents(
    store: ObjectStore,
) -> None:
    batches = ObjectBatches(store)
    assert await batches.document_ids("b_1", "fp") is None
    await batches.put_document_ids("b_1", "fp", ["a", None, "7"])
    await batches.put_document_ids("b_1", "fp", ["other"])  # create-only: the first stays
    assert await batches.document_ids("b_1", "fp") == ["a", None, "7"]
    assert await batches.document_ids("b_1", "other-fp") is None
    assert await batches.document_ids("b_1", "") is None  # a manifest with no fingerprint


async def test_an_export_is_found_once_sealed_and_read_back_a_page_at_a_time(
    store: ObjectStore,
) -> None:
    batches = ObjectBatches(store)
    lines = [
        ResultLine(index=i, session_id=f"s_{i}", state=SessionState.COMPLETED, result={"n": i})
        for i in range(5)
    ]
    for page, start in enumerate(range(0, 5, 2)):
        await batches.put_results_page("b_1", page, lines[start : start + 2], generation=1)
        assert await batches.results("b_1", "jsonl", generation=1) is None, "not whole yet"
    await batches.seal_results("b_1", generation=1, pages=3)
    jsonl = await batches.results("b_1", "jsonl", generation=1)
    assert jsonl is not None
    chunks = [chunk async for chunk in jsonl]
    assert len(chunks) == 3, "one a page"
    assert [ResultLine.model_validate_json(x) for x in b"".join(chunks).splitlines()] == lines
    parquet = await batches.results("b_1", "parquet", generation=1)
    assert parquet is not None
    table = pq.read_table(io.BytesIO(b"".join([chunk async for chunk in parquet])))
    assert [json.loads(r) for r in table.column("result").to_pylist()] == [
        {"n": i} for i in range(5)
    ]
    assert await batches.results("b_1", "jsonl", generation=0) is None, "another generation's"
    assert await batches.results("b_1", "csv", generation=1) is None


class EndlessRace(MemoryObjectStore):
    """A cursor another writer creates and deletes again between every two calls."""

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        raise ObjectNotFound(key)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        raise ObjectExists(key)


async def test_a_cursor_write_that_loses_every_round_gives_up_to_be_retried() -> None:
    with pytest.raises(StorageUnavailable, match="writes lost"):
        await ObjectBatches(EndlessRace()).save_cursor("b_1", FanOutCursor(next=4))


async def test_deliveries_update_by_compare_and_swap(store: ObjectStore) -> None:
    deliveries = ObjectDeliveries(store)
    delivery = Delivery(
        delivery_id="d_1",
        tenant="acme",
        session_id="s_1",
        url="https://example.com/hook",
        event_type="session.completed",
        payload={"type": "session.completed"},
        created_at=NOW,
    )
    assert await deliveries.create(delivery)
    assert not await deliveries.create(delivery)  # an outbox replay

    def attempt(d: Delivery) -> Delivery:
        return d.model_copy(update={"attempts": d.attempts + 1})

    await asyncio.gather(*(deliveries.update("acme", "d_1", attempt) for _ in range(5)))
    assert (await deliveries.get("acme", "d_1")).attempts == 5, "no update was lost"
    page, cursor = await deliveries.list(
        "acme", status=DeliveryStatus.PENDING, cursor=None, limit=5
    )
    assert [d.delivery_id for d in page] == ["d_1"] and cursor is None
    with pytest.raises(NotFound):
        await deliveries.get("acme", "d_404")
    assert not (await deliveries.endpoint("acme", delivery.url)).disabled
    await deliveries.set_endpoint("acme", EndpointState(url=delivery.url, disabled=True))
    assert (await deliveries.endpoint("acme", delivery.url)).disabled


def a_delivery(delivery_id: str) -> Delivery:
    return Delivery(
        delivery_id=delivery_id,
        tenant="acme",
        session_id=f"s_{delivery_id}",
        url="https://example.com/hook",
        event_type="session.completed",
        payload={"type": "session.completed"},
        created_at=NOW,
    )


async def test_the_pending_deliveries_are_found_without_reading_the_settled_ones(
    store: ObjectStore,
) -> None:
    """The repair looks for pending deliveries at every periodic pass: it read every
    delivery the tenant ever had (30 days of them), one object each. Through the pending
    markers it reads the pending ones, whatever the history."""
    deliveries = ObjectDeliveries(store)
    for i in range(40):
        assert await deliveries.create(a_delivery(f"d_{i:03d}"))
        if i % 10:  # all but four are delivered
            await deliveries.update(
                "acme",
                f"d_{i:03d}",
                lambda d: d.model_copy(update={"status": DeliveryStatus.DELIVERED}),
            )
    read = keys_read(store)
    page, cursor = await deliveries.list(
        "acme", status=DeliveryStatus.PENDING, cursor=None, limit=100
    )
    assert [d.delivery_id for d in page] == ["d_000", "d_010", "d_020", "d_030"]
    assert cursor is None and len(read) == 4, read
    # Sent again by an operator: pending again, and found again.
    await deliveries.update(
        "acme", "d_001", lambda d: d.model_copy(update={"status": DeliveryStatus.PENDING})
    )
    page, _ = await deliveries.list("acme", status=DeliveryStatus.PENDING, cursor=None, limit=100)
    assert "d_001" in [d.delivery_id for d in page]
    # A full read still finds what has no marker (a delivery stored before they existed).
    await store.delete(keys.pending_delivery("acme", "d_000"))
    page, _ = await deliveries.list(
        "acme", status=DeliveryStatus.PENDING, cursor=None, limit=100, full=True
    )
    assert "d_000" in [d.delivery_id for d in page]


async def test_a_run_of_stale_markers_is_read_a_bounded_part_at_a_time() -> None:
    """Markers whose delivery left the state (or is gone) are skipped: a run of them was
    read whole in one request. A page now stops at SCAN_MAX, its cursor going on."""
    store = MemoryObjectStore()
    deliveries = ObjectDeliveries(store)
    for i in range(SCAN_MAX + 20):
        await store.put(keys.dead_letter("acme", f"d_{i:05d}"), b"")  # stale: no delivery
    dead = a_delivery("d_zzzzz")
    assert await deliveries.create(dead)
    await deliveries.update(
        "acme", dead.delivery_id, lambda d: d.model_copy(update={"status": DeliveryStatus.DEAD})
    )
    read = keys_read(store)
    page, cursor = await deliveries.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=10)
    assert page == [] and cursor is not None and len(read) <= SCAN_MAX
    page, cursor = await deliveries.list(
        "acme", status=DeliveryStatus.DEAD, cursor=cursor, limit=10
    )
    assert [d.delivery_id for d in page] == ["d_zzzzz"] and cursor is None
