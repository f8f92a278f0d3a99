"""Repair after a flushed index walks the live sessions, found through their markers in
object storage, and never reads the snapshots of sessions that ended long ago.

Real Redis (flushed for real), a local folder for objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from storage.snapshots import ObjectSnapshots
from tests.runtime.test_sweeper import Recording, flush_index
from tests.support.harness import Env, local_env
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState
from torpor.ports import ListPage, ObjectStore, Reason, StoredObject
from torpor.service import repair
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper, SweepReport


class Reads:
    """Wraps the store, recording which snapshots were read."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.snapshots_read: set[str] = set()

    @property
    def url(self) -> str:
        return self.inner.url

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        if key.startswith(keys.SNAPSHOTS):
            self.snapshots_read.add(keys.session_id_of_snapshot(key))
        return await self.inner.get(key, max_bytes=max_bytes)

    async def put(self, key: str, data: bytes) -> str:
        return await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        return await self.inner.put_if_absent(key, data, durable=durable)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        return await self.inner.put_if_match(key, data, etag=etag)

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        assert prefix != keys.SNAPSHOTS, "repair listed every snapshot"
        return await self.inner.list(prefix, start_after=start_after, limit=limit)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


async def test_repair_after_a_flush_finds_exactly_the_live_sessions(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    old = [await env.submit(doc=f"PR-O{i}") for i in range(3)]
    for sid in old:
        await env.answer(sid, {"status": "approved"})
        assert (await env.load(sid)).state is SessionState.COMPLETED
    await Sweeper(env.control).sweep_once()  # the first repair backfills and marks complete
    env.clock.advance(30 * 24 * 3600.0)  # the old ones ended long ago (past binding grace)
    sleeping = [await env.submit(doc=f"PR-S{i}") for i in range(4)]
    live_keys = (await env.services.store.list(keys.LIVE)).keys
    assert sorted(live_keys) == sorted(keys.live(sid) for sid in sleeping)

    await flush_index(redis_url, redis_prefix)
    reads = Reads(env.services.store)
    env.services.snapshots = ObjectSnapshots(reads)
    activator = Recording()
    sweeper = Sweeper(SessionService(env.services, activator))  # type: ignore[arg-type]
    report = SweepReport()
    await sweeper.repair(env.clock.now(), report)

    assert report.repaired_waits == len(sleeping) and report.suspended == len(sleeping)
    assert reads.snapshots_read == set(sleeping), "no ended session's snapshot was read"
    states = await env.services.index.session_states(sleeping + old)
    assert states == {sid: SessionState.SUSPENDED for sid in sleeping}
    for sid in sleeping:  # the waits answer again through the rebuilt index
        wait = (await env.load(sid)).waits[0]
        assert await env.services.index.resolve(
            tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
        )
    assert all(reason is not Reason.RECOVER for _, reason in activator.requests)


async def test_a_store_from_before_the_markers_is_backfilled_once(env: Env) -> None:
    sid = await env.submit(doc="PR-B")
    store = env.services.store
    await store.delete(keys.live(sid))  # as a 0.1 store had it: no markers at all
    await store.delete(keys.MARKERS_COMPLETE)
    fresh = ObjectSnapshots(store)
    found = [h.session_id async for h in fresh.list_live(now=env.clock.now())]
    assert found == [sid]
    await store.get(keys.MARKERS_COMPLETE)  # written: later repairs skip the full listing
    later = env.clock.now() + timedelta(hours=2)
    assert [h.session_id async for h in ObjectSnapshots(store).list_live(now=later)] == [sid]


class InFlight:
    """How many calls of one real method run at once, at most. The first calls wait (up
    to a deadline) until ``together`` of them are in flight: repair run one session at
    a time never gets there, and is let through after the deadline, once."""

    def __init__(
        self, call: Callable[..., Awaitable[object]], *, together: int, fail_at: int = 0
    ) -> None:
        self.call, self.fail_at, self.together = call, fail_at, together
        self.now = self.most = self.calls = 0
        self.met = asyncio.Event()

    async def __call__(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        if self.calls == self.fail_at:
            raise IndexUnavailable("the index went away mid-repair")
        self.now += 1
        self.most = max(self.most, self.now)
        if self.now >= self.together:
            self.met.set()
        try:
            if not self.met.is_set():
                try:
                    await asyncio.wait_for(self.met.wait(), timeout=2.0)
                except TimeoutError:
                    self.met.set()  # never together: the rest go straight through
            return await self.call(*args, **kwargs)
        finally:
            self.now -= 1


async def test_repair_rebinds_many_sessions_at_once_and_counts_each(
    env: Env, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One session after another, a million sleeping ones took hours: they are repaired
    ``AT_ONCE`` at a time, and every wait is counted (a total added to across awaits)."""
    monkeypatch.setattr(repair, "AT_ONCE", 4)
    sleeping = [await env.submit(doc=f"PR-M{i}") for i in range(12)]
    await Sweeper(env.control).sweep_once()
    await flush_index(redis_url, redis_prefix)
    binds = InFlight(env.services.index.bind_wait, together=4)
    monkeypatch.setattr(env.services.index, "bind_wait", binds)
    report = SweepReport()
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.repair(env.clock.now(), report)
    assert report.repaired_waits == len(sleeping) and report.suspended == len(sleeping)
    assert binds.most == 4, "four sessions rebound at once, never more"
    for sid in sleeping:
        wait = (await env.load(sid)).waits[0]
        assert await env.services.index.resolve(
            tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
        )


async def test_a_repair_that_fails_on_one_session_raises_that_error_and_stops_the_rest(
    env: Env, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error as it is (the reconciler reports an unavailable index as such, not as a
    group of errors), and no session's repair left running behind it."""
    monkeypatch.setattr(repair, "AT_ONCE", 4)
    for i in range(8):
        await env.submit(doc=f"PR-F{i}")
    await Sweeper(env.control).sweep_once()
    await flush_index(redis_url, redis_prefix)
    binds = InFlight(env.services.index.bind_wait, together=4, fail_at=3)
    monkeypatch.setattr(env.services.index, "bind_wait", binds)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    with pytest.raises(IndexUnavailable):
        await sweeper.repair(env.clock.now(), SweepReport())
    assert binds.now == 0, "the others were stopped before the error was raised"
    assert not await env.services.index.is_intact(), "not marked intact"
