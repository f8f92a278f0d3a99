"""Retention survives a crash at any delete: the next sweep finishes the job, and a
session is never left half-deleted yet invisible to retention."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from pydantic import JsonValue

from storage import keys
from storage.batches import ObjectBatches
from storage.codec import SnapshotCodec
from storage.correlations import ObjectCorrelations
from storage.deliveries import ObjectDeliveries
from storage.inbox import ObjectInbox
from storage.memory_store import MemoryObjectStore
from storage.retention import BATCH_GRACE, SESSIONS_PER_BATCH_VISIT, ObjectRetention
from storage.snapshots import ObjectSnapshots, ended_day
from storage.submit_keys import ObjectSubmitKeys, key_digest
from storage.work import ObjectProgress, WorkRecords
from tests.support.factories import NOW, snapshot
from torpor.batches import BatchManifest, FanOutCursor, RetryGeneration
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.ids import business_idempotency_key, new_correlation_id, new_trace_id
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION
from torpor.ports import ListPage, StoredObject, SubmitKey, WaitBinding
from torpor.work import Progress, WorkOrder, work_id

KEEP, WINDOWS = timedelta(days=30), timedelta(hours=24)


class Crash(Exception):
    pass


async def remaining(store: MemoryObjectStore) -> list[str]:
    """Every key in the store but retention's own note that its one-time pass over the
    replay markers was made (``keys.REPLAYS_LISTED``): no session's or batch's."""
    return [k for k in (await store.list("")).keys if k != keys.REPLAYS_LISTED]


class CrashingDeletes(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.crash_at: str | None = None

    def _maybe_crash(self, key: str) -> None:
        if self.crash_at is not None and key.startswith(self.crash_at):
            self.crash_at = None
            raise Crash(key)

    async def delete(self, key: str) -> None:
        self._maybe_crash(key)
        await super().delete(key)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        self._maybe_crash(key)  # a business-key pointer's delete
        return await super().delete_if_match(key, etag=etag)


async def ended(store: CrashingDeletes) -> str:
    """An ended session with a long history (sealed into chunks), a correlation record and
    business-key pointer, a finished compute work and its progress report."""
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot(state=SessionState.RUNNING, messages=200))
    assert snap.chunks.messages  # the history is sealed into chunk objects
    await snapshots.save(
        snap.model_copy(update={"state": SessionState.COMPLETED}), expected_generation=0
    )
    binding = WaitBinding(
        tenant=snap.tenant,
        correlation_id=new_correlation_id(),
        session_id=snap.session_id,
        epoch=1,
        step_id="1",
        deadline=NOW,
    )
    await ObjectCorrelations(store).record(binding, business_key="PR-C")
    key = business_idempotency_key(snap.tenant, f"crunch:{snap.session_id}:c1", 1)
    order = WorkOrder(
        work_id=work_id(key),
        idempotency_key=key,
        tool_name="crunch",
        session_id=snap.session_id,
        tenant=snap.tenant,
        correlation_id=binding.correlation_id,
        epoch=1,
        request={},
        # Past the retention period by the sweep only if it has an outcome (it has).
        deadline=NOW + timedelta(days=10),
        trace_id=new_trace_id(),
    )
    await WorkRecords(store).save_order(order)
    await WorkRecords(store).record_outcome(order.work_id, {"status": "ok", "result": 1})
    await ObjectProgress(store).report(
        snap.session_id, Progress(work_id=order.work_id, tool_name="crunch", fraction=1, at=NOW)
    )
    await ObjectInbox(store).deliver(
        InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=snap.session_id,
            source="oa",
            event_id="e1",
            type="t",
            received_at=NOW,
        )
    )
    return snap.session_id


@pytest.mark.parametrize(
    "crash_at",
    [
        "chunks/",
        "business-keys/",
        "work/",
        "progress/",
        "correlations/",
        "inbox/",
        "refs/",
        "snapshots/",
        "live/",
        "ended/",
    ],
)
async def test_a_crash_mid_purge_is_finished_by_the_next_sweep(crash_at: str) -> None:
    store = CrashingDeletes()
    sid = await ended(store)
    assert (await store.list(keys.ENDED)).keys != []
    assert (await store.list(keys.LIVE)).keys == []  # ended: no longer a live session
    retention = ObjectRetention(store)
    later = NOW + KEEP + timedelta(days=1)

    store.crash_at = crash_at
    crash_at_time = later
    if crash_at == "ended/":  # the ended marker goes a window after the rest
        await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
        crash_at_time = later + WINDOWS
    with pytest.raises(Crash):
        await retention.sweep(now=crash_at_time, keep=KEEP, windows=WINDOWS, limit=10)
    if crash_at not in ("snapshots/", "chunks/", "live/", "ended/"):
        # Stopped before its snapshot: the session still loads whole, history and all
        # (a late webhook's activation must not find it corrupt and quarantine it).
        assert (await ObjectSnapshots(store).load(sid)).messages
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)

    with pytest.raises(SessionNotFound):
        await ObjectSnapshots(store).load(sid)
    # The ended marker stays a window after the snapshot (late callbacks), then goes.
    assert await remaining(store) == (await store.list(keys.ENDED)).keys
    await ObjectRetention(store).sweep(now=later + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


async def fanned_out_batch(store: MemoryObjectStore, *, cancelled: bool, total: int = 2) -> str:
    """A batch past its fan-out (or cancelled before it) whose sessions are all gone, with
    every kind of object beside its manifest."""
    batches = ObjectBatches(store)
    batch_id = "b_retention_crash"
    docs: list[JsonValue] = [{"doc": i} for i in range(total)]
    documents = await batches.put_documents(batch_id, "f" * 16, docs)
    manifest = BatchManifest(
        batch_id=batch_id,
        tenant="acme",
        agent="fin",
        created_at=NOW,
        total=total,
        documents_key=documents,
    )
    assert await batches.create(manifest)
    if cancelled:
        await batches.mark_cancelled(batch_id)
    else:
        await batches.save_cursor(batch_id, FanOutCursor(next=total))
        await batches.add_generation(
            batch_id, RetryGeneration(generation=1, documents=[1], created_at=NOW)
        )
        await store.put(keys.batch_results(batch_id, "jsonl"), b"{}\n")
    return batch_id


# Each object a purge deletes, in each kind of batch that has it.
BATCH_CRASHES = [
    *((False, at) for at in ("documents-", "retry-", "results.", "fanout", "batches/")),
    *((True, at) for at in ("documents-", "cancelled", "batches/")),
]


@pytest.mark.parametrize(
    ("cancelled", "crash_at"),
    BATCH_CRASHES,
    ids=[f"{'cancelled' if c else 'fanned-out'}-{at}" for c, at in BATCH_CRASHES],
)
async def test_a_crash_mid_batch_purge_is_finished_by_the_next_sweep(
    crash_at: str, cancelled: bool
) -> None:
    """Whatever delete a crash stops, the batch is still found (its manifest), still
    judged as before (its cursor or cancel marker), and the next sweep finishes it."""
    store = CrashingDeletes()
    batch_id = await fanned_out_batch(store, cancelled=cancelled)
    later = NOW + KEEP + timedelta(days=1)
    stored = await remaining(store)
    [store.crash_at] = [k for k in stored if crash_at in k]
    with pytest.raises(Crash):
        await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert keys.batch(batch_id) in await remaining(store)
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


class CountingHeaders(MemoryObjectStore):
    """Counts the snapshot reads; writes ``late`` beside the manifest when it is deleted
    (a cancel or an export that read the manifest just before)."""

    def __init__(self) -> None:
        super().__init__()
        self.snapshot_reads = 0
        self.late: str | None = None

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        if key.startswith(keys.SNAPSHOTS):
            self.snapshot_reads += 1
        return await super().get(key, max_bytes=max_bytes)

    async def delete(self, key: str) -> None:
        await super().delete(key)
        if self.late is not None and key.startswith(keys.BATCHES):
            await self.put(self.late, b"{}")


async def test_a_large_batch_is_looked_through_a_bounded_number_of_sessions_a_visit() -> None:
    """600 documents: a visit reads at most SESSIONS_PER_BATCH_VISIT snapshots, the next
    one goes on where the last stopped (or starts at the one found still stored), and the
    batch goes once every session is known gone."""
    store = CountingHeaders()
    batch_id = await fanned_out_batch(store, cancelled=False, total=600)
    manifest = await ObjectBatches(store).get(batch_id)
    snapshots = ObjectSnapshots(store)
    keeper = manifest.session_id(0)  # the first document's: looked at last
    await snapshots.create(snapshot(session_id=keeper, state=SessionState.COMPLETED))
    retention = ObjectRetention(store)
    later = NOW + KEEP + timedelta(days=1)

    async def visit() -> int:
        store.snapshot_reads = 0
        await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
        return store.snapshot_reads

    sessions = 600 + 1  # and the retried document's second session
    assert await visit() == SESSIONS_PER_BATCH_VISIT
    assert await visit() == SESSIONS_PER_BATCH_VISIT
    assert await visit() == sessions - 2 * SESSIONS_PER_BATCH_VISIT  # found: the keeper
    assert await visit() == 1  # from the keeper on: one read while it stays
    assert keys.batch(batch_id) in (await store.list(keys.BATCHES)).keys
    await store.delete(keys.snapshot(keeper))
    assert await visit() == 1
    assert (await store.list(keys.BATCHES)).keys == (await store.list(keys.BATCH_DATA)).keys == []


async def test_what_a_cancel_writes_beside_a_batch_while_it_goes_goes_too() -> None:
    store = CountingHeaders()
    batch_id = await fanned_out_batch(store, cancelled=False)
    store.late = keys.batch_cancelled(batch_id)
    later = NOW + KEEP + timedelta(days=1)
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


async def test_a_batch_waits_an_hour_past_the_period_for_a_retry_begun_inside_it() -> None:
    store = CountingHeaders()
    batch_id = await fanned_out_batch(store, cancelled=False)
    retention = ObjectRetention(store)
    inside = NOW + KEEP + BATCH_GRACE / 2
    await retention.sweep(now=inside, keep=KEEP, windows=WINDOWS, limit=10)
    assert keys.batch(batch_id) in (await store.list(keys.BATCHES)).keys
    await retention.sweep(now=inside + BATCH_GRACE, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


async def test_a_session_a_newer_torpor_wrote_is_kept_and_skipped_not_an_error() -> None:
    """Mid-upgrade a newer node writes at a schema this one does not know: retention keeps
    the session (the newer node judges it), and the listings repair walks skip it, where
    the error stopped the whole sweep or repair."""
    store = CrashingDeletes()
    sid = await ended(store)
    live = await ObjectSnapshots(store).create(snapshot(state=SessionState.SUSPENDED))
    for session_id in (sid, live.session_id):
        newer = (await ObjectSnapshots(store).load_stored(session_id)).model_copy(
            update={"schema_version": SCHEMA_VERSION + 1}
        )
        await store.put(keys.snapshot(session_id), SnapshotCodec().encode(newer))
    later = NOW + KEEP + timedelta(days=1)
    report = await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert report.purged == [] and report.kept == 1
    snapshots = ObjectSnapshots(store)
    assert [h async for h in snapshots.list_live(now=later)] == []
    assert [h async for h in snapshots.list_live_waiting(now=later)] == []
    assert [h async for h in snapshots.list_by_state()] == []


async def test_a_batch_from_before_documents_were_kept_goes_too() -> None:
    """A manifest with a total but no documents object: no fan-out can make its sessions
    (it refuses one), so its cursor is no reason to keep it."""
    store = CrashingDeletes()
    manifest = BatchManifest(
        batch_id="b_no_documents", tenant="acme", agent="fin", created_at=NOW, total=2
    )
    assert await ObjectBatches(store).create(manifest)
    later = NOW + KEEP + timedelta(days=1)
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


async def test_an_accept_note_left_beside_a_manifest_goes_and_the_batch_stays() -> None:
    """An accept that died after its manifest, before it removed its note: the note goes
    on the next visit, whatever its age; the batch is judged by its manifest."""
    store = MemoryObjectStore()
    batch_id = await fanned_out_batch(store, cancelled=False)
    await ObjectBatches(store).mark_accepting(batch_id, NOW)
    await ObjectRetention(store).sweep(now=NOW, keep=KEEP, windows=WINDOWS, limit=10)
    assert (await store.list(keys.BATCH_ACCEPTS)).keys == []
    assert keys.batch(batch_id) in (await store.list(keys.BATCHES)).keys


async def store_late_callback(
    store: MemoryObjectStore, session_id: str, at: datetime, *, stamped: bool
) -> None:
    """What a gateway stores for a CLOSED answer to ``session_id``: its event, then its
    replay marker (with the time it was received, as the gateway stamps it now, or
    without, as markers were written before), named by the event."""
    late = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=session_id,
        source="oa",
        event_id="e-late",
        type="t",
        received_at=at,
    ).model_copy(update={"content_digest": "d" * 64})
    inbox = ObjectInbox(store)
    await inbox.deliver(late)
    stamp = at if stamped else None
    await inbox.remember_accepted(source="oa", content_digest="d" * 64, at=stamp, in_inbox=True)


class LateCallback(CrashingDeletes):
    """A gateway that found the session (its correlation record and header) before the
    purge, and stores its CLOSED answer, then its replay marker, only after the purge
    listed the inbox the last time (a paused replica, a slow store)."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id: str | None = None
        self.inbox_listings = 0

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        page = await super().list(prefix, start_after=start_after, limit=limit)
        if self.session_id is not None and prefix == keys.inbox_prefix(self.session_id):
            self.inbox_listings += 1
            if self.inbox_listings == 2:  # the purge's look for late events
                await store_late_callback(self, self.session_id, NOW + KEEP, stamped=False)
        return page


async def test_a_late_callback_stored_after_the_purges_last_look_goes_too() -> None:
    """Nothing finds a session's inbox once its snapshot and ended marker are gone: an
    event (and replay marker) a late callback stored after the purge's last listing of
    the inbox stayed for ever. The purge now looks again a window later."""
    store = LateCallback()
    sid = await ended(store)
    store.session_id = sid
    later = NOW + KEEP + timedelta(days=1)
    retention = ObjectRetention(store)
    await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    with pytest.raises(SessionNotFound):
        await ObjectSnapshots(store).load(sid)
    late = (await store.list(keys.inbox_prefix(sid))).keys
    assert late and (await store.list(keys.ENDED)).keys  # its marker finds it again
    await retention.sweep(now=later + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


async def another_wait_takes_the_key(store: MemoryObjectStore) -> WaitBinding:
    """Another session's new wait takes business key ``PR-C`` (its pointer rewritten)."""
    taken = WaitBinding(
        tenant="acme",
        correlation_id=new_correlation_id(),
        session_id="s_other",
        epoch=1,
        step_id="1",
        deadline=NOW + KEEP + timedelta(days=2),
    )
    await ObjectCorrelations(store).record(taken, business_key="PR-C")
    return taken


class KeyTakenMidPurge(MemoryObjectStore):
    """Another session's new wait takes business key ``PR-C`` while the purge runs:
    after the purge found the pointer naming its session's wait, before it deleted it."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id = ""
        self.taken: WaitBinding | None = None

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        # Listed after the purge judged the pointer, before its first delete.
        mid_purge = self.session_id and prefix == keys.progress_prefix(self.session_id)
        if mid_purge and self.taken is None:
            self.taken = await another_wait_takes_the_key(self)
        return await super().list(prefix, start_after=start_after, limit=limit)


@pytest.mark.parametrize("refs", [True, False], ids=["refs", "0.2-no-refs"])
async def test_a_business_key_taken_by_another_wait_mid_purge_keeps_its_pointer(
    refs: bool,
) -> None:
    """The pointer was judged the purged session's early and deleted unconditionally
    later: the new wait's pointer went, and after an index miss a webhook addressed by
    the business key found no wait (nor did repair mend the key's index entry)."""
    store = KeyTakenMidPurge()
    sid = await ended(store)
    if not refs:  # as 0.2 left it: found through the snapshot's business keys
        snap = await ObjectSnapshots(store).load(sid)
        refs_of = (await store.list(keys.refs_prefix(sid))).keys
        [cid] = [r.rsplit("/", 1)[1] for r in refs_of if "/c/" in r]
        stored = snap.model_copy(update={"business_keys": {"PR-C": 1}})
        await store.delete(keys.snapshot(sid))
        await store.put(keys.snapshot(sid), SnapshotCodec().encode(stored))
        for ref in refs_of:
            await store.delete(ref)
        assert (
            await ObjectCorrelations(store).business_key_target(tenant="acme", business_key="PR-C")
        ) == cid
    store.session_id = sid
    later = NOW + KEEP + timedelta(days=1)
    report = await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert [s for _, s in report.purged] == [sid] and store.taken is not None
    found = await ObjectCorrelations(store).lookup_business_key(tenant="acme", business_key="PR-C")
    assert found == store.taken


class CallbackDuringPurge(MemoryObjectStore):
    """A late callback, routed through the correlation record before it went, stored
    (event, then replay marker stamped as the gateway stamps it) just before the purge's
    look for late events: a request signed moments ago."""

    def __init__(self, at: datetime) -> None:
        super().__init__()
        self.session_id, self.at, self.inbox_listings = "", at, 0

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        if self.session_id and prefix == keys.inbox_prefix(self.session_id):
            self.inbox_listings += 1
            if self.inbox_listings == 2:  # the purge's look for late events
                await store_late_callback(self, self.session_id, self.at, stamped=True)
        return await super().list(prefix, start_after=start_after, limit=limit)


async def test_a_late_callbacks_replay_marker_outlives_its_signature_window() -> None:
    """The purge deleted a late event's replay marker with the event, seconds after its
    request: a captured copy replayed within the signature's tolerance got past the
    index's claim (a held claim is no replay without the marker) and, addressed by
    business key alone, could answer a newer wait that took the key. It now stays until
    its own stamp is past the period (``_sweep_replays``), as every other marker does."""
    later = NOW + KEEP + timedelta(days=1)
    store = CallbackDuringPurge(at=later)
    sid = await ended(store)
    inbox, retention = ObjectInbox(store), ObjectRetention(store)
    # Markers written from now on are listed as they are made (the one-time pass over
    # those stored before is over): the late one by the purge that keeps it.
    await retention.sweep(now=NOW, keep=KEEP, windows=WINDOWS, limit=10)
    store.session_id = sid
    await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert (await store.list(keys.inbox_prefix(sid))).keys == []  # the late event went
    assert await inbox.was_accepted(source="oa", content_digest="d" * 64)
    await retention.sweep(now=later + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    assert await inbox.was_accepted(source="oa", content_digest="d" * 64)
    await retention.sweep(now=later + KEEP + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    assert await remaining(store) == []


class CountsWork(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.marker_writes = self.whole_reads = 0

    async def put(self, key: str, data: bytes) -> str:
        self.marker_writes += key.startswith(keys.ENDED)
        return await super().put(key, data)

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        self.whole_reads += key.startswith(keys.SNAPSHOTS) and max_bytes is None
        return await super().get(key, max_bytes=max_bytes)


async def test_a_session_that_ended_after_the_cutoff_on_its_day_costs_a_header_read() -> None:
    """Ended on the cutoff's day, after the cutoff: every sweep (every 5 s, all that
    day) read the whole snapshot and wrote its ended marker again, where it already was
    (a flushed write on the local folder each time)."""
    store = CountsWork()
    sid = await ended(store)
    header = await ObjectSnapshots(store).header(sid)
    marker = keys.ended(ended_day(header.updated_at), sid)
    assert (await store.list(keys.ENDED)).keys == [marker]
    retention = ObjectRetention(store)
    store.marker_writes = store.whole_reads = 0
    now = header.updated_at + KEEP - timedelta(minutes=1)  # the cutoff: a minute before
    for _ in range(3):
        report = await retention.sweep(now=now, keep=KEEP, windows=WINDOWS, limit=10)
        assert report.kept == 1 and report.purged == []
    assert (store.marker_writes, store.whole_reads) == (0, 0)
    assert (await store.list(keys.ENDED)).keys == [marker]
    report = await retention.sweep(
        now=now + timedelta(minutes=2), keep=KEEP, windows=WINDOWS, limit=10
    )
    assert [s for _, s in report.purged] == [sid]


class KeyTakenAtItsDelete(MemoryObjectStore):
    """Another session's new wait takes business key ``PR-C`` at the last moment: after
    the purge read the pointer again (still naming its session's wait), before the
    pointer's delete reaches the store."""

    def __init__(self) -> None:
        super().__init__()
        self.pointer = keys.business_key("acme", "PR-C")
        self.armed = False
        self.taken: WaitBinding | None = None

    async def _take_first(self, key: str) -> None:
        if self.armed and key == self.pointer and self.taken is None:
            self.taken = await another_wait_takes_the_key(self)

    async def delete(self, key: str) -> None:
        await self._take_first(key)
        await super().delete(key)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        await self._take_first(key)
        return await super().delete_if_match(key, etag=etag)


async def test_a_business_key_taken_just_before_its_pointers_delete_keeps_it() -> None:
    """The pointer was read again right before its delete, but deleted unconditionally:
    a wait that took the key in that one round trip lost its pointer (after an index
    miss a webhook addressed by the business key found no wait). The delete is
    conditional on the etag read: the new pointer stays."""
    store = KeyTakenAtItsDelete()
    sid = await ended(store)
    store.armed = True
    later = NOW + KEEP + timedelta(days=1)
    report = await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert [s for _, s in report.purged] == [sid] and store.taken is not None
    found = await ObjectCorrelations(store).lookup_business_key(tenant="acme", business_key="PR-C")
    assert found == store.taken


class ResentMidPurge(MemoryObjectStore):
    """An operator resends a dead letter of the ended session (``dead_letters.resend``
    commits it again) after the purge judged it, before it deleted the snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id = ""
        self.resent_at: datetime | None = None

    async def delete(self, key: str) -> None:
        judged = self.session_id and key.startswith(keys.refs_prefix(self.session_id))
        if judged and self.resent_at is None:
            self.resent_at = NOW + KEEP + timedelta(days=1)
            stored = await ObjectSnapshots(self).load_stored(self.session_id)
            revived = stored.model_copy(
                update={"generation": stored.generation + 1, "updated_at": self.resent_at}
            )
            await super().put(keys.snapshot(self.session_id), SnapshotCodec().encode(revived))
        await super().delete(key)


async def test_a_session_committed_again_mid_purge_keeps_its_snapshot() -> None:
    """The snapshot was judged early and deleted unconditionally last: the operator's
    resend was answered as done, and the session it revived was deleted with it."""
    store = ResentMidPurge()
    sid = await ended(store)
    store.session_id = sid
    later = NOW + KEEP + timedelta(days=1)
    retention = ObjectRetention(store)
    report = await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert store.resent_at is not None
    assert report.purged == [] and report.kept == 1
    kept = await ObjectSnapshots(store).load(sid)
    assert kept.updated_at == store.resent_at
    # Judged again as it is now: changed a moment ago, so kept a whole period more.
    report = await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert report.purged == [] and report.kept == 1
    assert (await ObjectSnapshots(store).load(sid)).updated_at == store.resent_at


class DeliveryResentMidPurge(MemoryObjectStore):
    """An operator resends the session's dead delivery (a compare-and-swap to PENDING)
    after the purge judged it settled, before the purge's first delete."""

    def __init__(self) -> None:
        super().__init__()
        self.session_id = ""
        self.resent: Delivery | None = None

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        mid_purge = self.session_id and prefix == keys.progress_prefix(self.session_id)
        if mid_purge and self.resent is None:
            self.resent = await ObjectDeliveries(self).update(
                "acme",
                "d_dead",
                lambda d: d.model_copy(update={"status": DeliveryStatus.PENDING, "attempts": 0}),
            )
        return await super().list(prefix, start_after=start_after, limit=limit)


async def test_a_delivery_resent_mid_purge_is_kept_with_its_session() -> None:
    """The delivery was judged dead early and deleted blind with the other records: the
    resend was answered as done, and nothing was ever sent."""
    store = DeliveryResentMidPurge()
    sid = await ended(store)
    await ObjectDeliveries(store).create(
        Delivery(
            delivery_id="d_dead",
            tenant="acme",
            session_id=sid,
            url="https://hooks.example/x",
            event_type="session.completed",
            payload={},
            status=DeliveryStatus.DEAD,
            created_at=NOW,
        )
    )
    store.session_id = sid
    later = NOW + KEEP + timedelta(days=1)
    retention = ObjectRetention(store)
    report = await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert store.resent is not None
    assert report.purged == [] and report.kept == 1
    pending = await ObjectDeliveries(store).get("acme", "d_dead")
    assert pending.status is DeliveryStatus.PENDING
    assert keys.pending_delivery("acme", "d_dead") in (await store.list("pending-")).keys
    assert (await ObjectSnapshots(store).load(sid)).session_id == sid


async def test_a_replay_marker_stays_for_a_window_longer_than_the_period() -> None:
    """A source's tolerance (up to a day) makes the replay window up to three days, and
    the settings take a period of a day: markers went by the period alone, inside the
    window, and a captured copy of the request was accepted again."""
    store = MemoryObjectStore()
    inbox = ObjectInbox(store)
    await inbox.remember_accepted(source="oa", content_digest="e" * 64, at=NOW)
    day, windows = timedelta(days=1), timedelta(hours=36)
    retention = ObjectRetention(store)
    await retention.sweep(now=NOW + timedelta(hours=30), keep=day, windows=windows, limit=10)
    assert await inbox.was_accepted(source="oa", content_digest="e" * 64)
    await retention.sweep(now=NOW + timedelta(hours=37), keep=day, windows=windows, limit=10)
    assert not await inbox.was_accepted(source="oa", content_digest="e" * 64)


async def test_a_submit_key_whose_session_was_never_made_goes_after_the_period() -> None:
    """The record is written before the session: a create that failed, and that no retry
    of the key took over, left the record and its ref naming a session that no purge
    ever visits, for good."""
    store = MemoryObjectStore()
    made = await ObjectSnapshots(store).create(snapshot(state=SessionState.RUNNING))
    never = snapshot().session_id  # its create failed: never stored
    claims = ObjectSubmitKeys(store)
    for key, sid in (("order-1", never), ("order-2", made.session_id)):
        record = SubmitKey(session_id=sid, fingerprint="f", created_at=NOW)
        await claims.claim(tenant="acme", key=key, record=record, ttl=WINDOWS)
    lost = [
        keys.submit_key("acme", key_digest("order-1")),
        keys.submit_key_ref(never, "acme", key_digest("order-1")),
    ]
    retention = ObjectRetention(store)
    await retention.sweep(now=NOW + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    assert set(lost) <= set(await remaining(store)), "inside the period: kept"
    await retention.sweep(now=NOW + KEEP + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    left = await remaining(store)
    assert not set(lost) & set(left)
    assert keys.submit_key("acme", key_digest("order-2")) in left, "its session exists"


class SubmitKeyReads(MemoryObjectStore):
    """Counts the reads of submit-key records."""

    def __init__(self) -> None:
        super().__init__()
        self.record_reads = 0

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        self.record_reads += key.startswith(keys.SUBMIT_KEYS)
        return await super().get(key, max_bytes=max_bytes)


async def test_submit_key_records_are_read_in_one_pass_an_hour_not_at_every_sweep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass pages through every record, a page a sweep, then the records are left
    alone until an hour after the pass began: a large deployment's records were read,
    a page (and a snapshot header each) every 5 s, for ever."""
    monkeypatch.setattr("storage.retention_submit_keys.SUBMIT_KEYS_PER_SWEEP", 2)
    store = SubmitKeyReads()
    made = await ObjectSnapshots(store).create(snapshot(state=SessionState.RUNNING))
    claims = ObjectSubmitKeys(store)
    for n in range(3):
        record = SubmitKey(session_id=made.session_id, fingerprint="f", created_at=NOW)
        await claims.claim(tenant="acme", key=f"order-{n}", record=record, ttl=WINDOWS)
    retention = ObjectRetention(store)
    start, reads = NOW + WINDOWS, []
    for sweep in range(6):  # 5 s apart
        store.record_reads = 0
        now = start + timedelta(seconds=5 * sweep)
        await retention.sweep(now=now, keep=KEEP, windows=WINDOWS, limit=10)
        reads.append(store.record_reads)
    assert sum(reads[:2]) == 3 and sum(reads[2:]) == 0, reads
    store.record_reads = 0
    await retention.sweep(now=start + timedelta(hours=1), keep=KEEP, windows=WINDOWS, limit=10)
    assert store.record_reads == 2, "an hour on, the next pass begins"


async def test_a_stray_key_among_the_submit_key_records_is_skipped_not_raised() -> None:
    """A key under the records' prefix that ``keys.submit_key`` would not make (a stray
    object) named a ref no key may name: ``InvalidKey`` raised out of the whole
    retention pass, at every sweep that met it."""
    store = MemoryObjectStore()
    never = snapshot().session_id  # its create failed: never stored
    old = SubmitKey(session_id=never, fingerprint="f", created_at=NOW)
    await ObjectSubmitKeys(store).claim(tenant="acme", key="order-1", record=old, ttl=WINDOWS)
    stray = f"{keys.SUBMIT_KEYS}acme/nested/{key_digest('order-2')}"
    await store.put(stray, (await store.get(keys.submit_key("acme", key_digest("order-1")))).data)
    retention = ObjectRetention(store)
    await retention.sweep(now=NOW + KEEP + WINDOWS, keep=KEEP, windows=WINDOWS, limit=10)
    left = await remaining(store)
    assert keys.submit_key("acme", key_digest("order-1")) not in left, "the record went"
    assert stray in left, "the stray is left for an operator"


class ReplayReads(MemoryObjectStore):
    """Counts the reads of replay markers."""

    def __init__(self) -> None:
        super().__init__()
        self.marker_reads = 0

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        self.marker_reads += key.startswith(keys.REPLAYS)
        return await super().get(key, max_bytes=max_bytes)


async def test_a_sweep_reads_only_the_replay_markers_it_may_delete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round robin over the markers, every sweep read a page of them (256), every 5 s
    for ever, though none of them could go yet: a million sleeping sessions' markers were
    read through again and again. Found through their due entries, oldest hour first, a
    sweep with none due reads none, and one past their period reads each once."""
    monkeypatch.setattr("storage.retention_replays.REPLAYS_PER_SWEEP", 4)
    store = ReplayReads()
    retention = ObjectRetention(store)
    await retention.sweep(now=NOW, keep=KEEP, windows=WINDOWS, limit=10)  # a new store's
    inbox = ObjectInbox(store)
    for n in range(6):
        await inbox.remember_accepted(source="oa", content_digest=f"{n:064x}", at=NOW)
    store.marker_reads = 0
    for sweep in range(10):  # 5 s apart, a day on
        now = NOW + WINDOWS + timedelta(seconds=5 * sweep)
        await retention.sweep(now=now, keep=KEEP, windows=WINDOWS, limit=10)
    assert store.marker_reads == 0
    reads = []
    for sweep in range(3):  # past the period (and the hour it ends in)
        store.marker_reads = 0
        now = NOW + KEEP + timedelta(hours=1, seconds=5 * sweep)
        await retention.sweep(now=now, keep=KEEP, windows=WINDOWS, limit=10)
        reads.append(store.marker_reads)
    assert reads == [4, 2, 0]
    assert (await store.list(keys.REPLAYS)).keys == []
    assert (await store.list(keys.REPLAYS_DUE)).keys == [], "their entries went with them"


async def test_replay_markers_stored_before_due_entries_go_after_the_period_too() -> None:
    """A marker written by an older version has no due entry: a pass over the markers,
    made once, deletes the old ones and lists the young ones by their hour."""
    store = MemoryObjectStore()
    stamps = {"a" * 64: NOW, "b" * 64: NOW + KEEP}
    for content_digest, at in stamps.items():
        marker = keys.accepted_content("oa", content_digest)
        await store.put_if_absent(marker, at.isoformat().encode())
    retention = ObjectRetention(store)
    later = NOW + KEEP + timedelta(hours=1)
    await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert (await store.list(keys.REPLAYS)).keys == [keys.accepted_content("oa", "b" * 64)]
    assert keys.REPLAYS_LISTED in (await store.list(keys.REPLAYS_LISTED)).keys
    await retention.sweep(now=later + KEEP, keep=KEEP, windows=WINDOWS, limit=10)
    assert (await store.list(keys.REPLAYS)).keys == []


async def test_a_replay_marker_written_again_is_judged_by_its_own_stamp() -> None:
    """A marker deleted with its session's inbox and written again by a later request
    (a sender's redelivery a month on) is left by its first entry: it is as young as
    its second one says."""
    store = MemoryObjectStore()
    inbox, retention = ObjectInbox(store), ObjectRetention(store)
    await inbox.remember_accepted(source="oa", content_digest="c" * 64, at=NOW)
    await inbox.forget_accepted(source="oa", content_digest="c" * 64)  # as a purge deletes it
    again = NOW + KEEP
    await inbox.remember_accepted(source="oa", content_digest="c" * 64, at=again)
    await retention.sweep(now=again + timedelta(hours=2), keep=KEEP, windows=WINDOWS, limit=10)
    assert await inbox.was_accepted(source="oa", content_digest="c" * 64)
    [entry] = (await store.list(keys.REPLAYS_DUE)).keys
    assert keys.replay_due_parts(entry)[0] == again.strftime("%Y%m%d%H")
