"""Retention survives a crash at any delete: the next sweep finishes the job, and a
session is never left half-deleted yet invisible to retention."""

from __future__ import annotations

from datetime import timedelta

import pytest

from storage import keys
from storage.batches import ObjectBatches
from storage.correlations import ObjectCorrelations
from storage.inbox import ObjectInbox
from storage.memory_store import MemoryObjectStore
from storage.retention import ObjectRetention
from storage.snapshots import ObjectSnapshots
from storage.work import ObjectProgress, WorkRecords
from tests.support.factories import NOW, snapshot
from torpor.batches import BatchManifest, FanOutCursor, RetryGeneration
from torpor.errors import SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.ids import business_idempotency_key, new_correlation_id, new_trace_id
from torpor.lifecycle import SessionState
from torpor.ports import WaitBinding
from torpor.work import Progress, WorkOrder, work_id

KEEP, WINDOWS = timedelta(days=30), timedelta(hours=24)


class Crash(Exception):
    pass


class CrashingDeletes(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.crash_at: str | None = None

    async def delete(self, key: str) -> None:
        if self.crash_at is not None and key.startswith(self.crash_at):
            self.crash_at = None
            raise Crash(key)
        await super().delete(key)


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
    with pytest.raises(Crash):
        await retention.sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)

    with pytest.raises(SessionNotFound):
        await ObjectSnapshots(store).load(sid)
    assert (await store.list("")).keys == []


async def fanned_out_batch(store: CrashingDeletes, *, cancelled: bool) -> str:
    """A batch past its fan-out (or cancelled before it) whose sessions are all gone, with
    every kind of object beside its manifest."""
    batches = ObjectBatches(store)
    batch_id = "b_retention_crash"
    documents = await batches.put_documents(batch_id, "f" * 16, [{"doc": 0}, {"doc": 1}])
    manifest = BatchManifest(
        batch_id=batch_id,
        tenant="acme",
        agent="fin",
        created_at=NOW,
        total=2,
        documents_key=documents,
    )
    assert await batches.create(manifest)
    if cancelled:
        await batches.mark_cancelled(batch_id)
    else:
        await batches.save_cursor(batch_id, FanOutCursor(next=2))
        await batches.add_generation(
            batch_id, RetryGeneration(generation=1, documents=[1], created_at=NOW)
        )
        await store.put(keys.batch_results(batch_id, "jsonl"), b"{}\n")
    return batch_id


@pytest.mark.parametrize("cancelled", [False, True], ids=["fanned-out", "cancelled"])
@pytest.mark.parametrize(
    "crash_at", ["documents-", "retry-", "results.", "fanout", "cancelled", "batches/"]
)
async def test_a_crash_mid_batch_purge_is_finished_by_the_next_sweep(
    crash_at: str, cancelled: bool
) -> None:
    """Whatever delete a crash stops, the batch is still found (its manifest), still
    judged as before (its cursor or cancel marker), and the next sweep finishes it."""
    store = CrashingDeletes()
    batch_id = await fanned_out_batch(store, cancelled=cancelled)
    later = NOW + KEEP + timedelta(days=1)
    stored = (await store.list("")).keys
    store.crash_at = next((k for k in stored if crash_at in k), None)
    if store.crash_at is not None:
        with pytest.raises(Crash):
            await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
        assert keys.batch(batch_id) in (await store.list("")).keys
    await ObjectRetention(store).sweep(now=later, keep=KEEP, windows=WINDOWS, limit=10)
    assert (await store.list("")).keys == []
