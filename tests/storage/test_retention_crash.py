"""Retention survives a crash at any delete: the next sweep finishes the job, and a
session is never left half-deleted yet invisible to retention."""

from __future__ import annotations

from datetime import timedelta

import pytest

from storage import keys
from storage.inbox import ObjectInbox
from storage.memory_store import MemoryObjectStore
from storage.retention import ObjectRetention
from storage.snapshots import ObjectSnapshots
from tests.support.factories import NOW, snapshot
from torpor.errors import SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState

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
    snapshots = ObjectSnapshots(store)
    snap = await snapshots.create(snapshot(state=SessionState.RUNNING))
    await snapshots.save(
        snap.model_copy(update={"state": SessionState.COMPLETED}), expected_generation=0
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


@pytest.mark.parametrize("crash_at", ["inbox/", "snapshots/", "ended/"])
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
