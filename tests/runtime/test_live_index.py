"""Repair after a flushed index walks the live sessions, found through their markers in
object storage, and never reads the snapshots of sessions that ended long ago.

Real Redis (flushed for real), a local folder for objects."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from storage.correlations import ObjectCorrelations
from storage.redis_index import RedisIndex
from storage.snapshots import ObjectSnapshots
from tests.runtime.test_sweeper import Recording, flush_index
from tests.support.harness import Env, callback, local_env
from torpor.clock import to_ms
from torpor.errors import IndexUnavailable, StorageUnavailable
from torpor.ids import event_key
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus
from torpor.ports import ListPage, ObjectStore, Reason, StoredObject, TimerKind
from torpor.service import repair
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper, SweepReport


class Reads:
    """Wraps the store, recording which snapshots were read and which keys written."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.reads: Counter[str] = Counter()  # key -> reads of it
        self.whole: Counter[str] = Counter()  # key -> reads of all of it (not ranged)
        self.written: list[str] = []

    @property
    def snapshots_read(self) -> set[str]:
        return {keys.session_id_of_snapshot(k) for k in self.reads if k.startswith(keys.SNAPSHOTS)}

    @property
    def url(self) -> str:
        return self.inner.url

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        self.reads[key] += 1
        if max_bytes is None:
            self.whole[key] += 1
        return await self.inner.get(key, max_bytes=max_bytes)

    async def put(self, key: str, data: bytes) -> str:
        self.written.append(key)
        return await self.inner.put(key, data)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        self.written.append(key)
        return await self.inner.put_if_absent(key, data, durable=durable)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        self.written.append(key)
        return await self.inner.put_if_match(key, data, etag=etag)

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        assert prefix != keys.SNAPSHOTS, "repair listed every snapshot"
        return await self.inner.list(prefix, start_after=start_after, limit=limit)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        return await self.inner.delete_if_match(key, etag=etag)

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
    # Whole once each: not a ranged read of its header and then the whole object. A
    # session whose wait it bound again gets one ranged read after the bind, to confirm
    # no commit closed the wait since the walk read it (``IndexRepair._still_open``).
    assert {reads.whole[keys.snapshot(sid)] for sid in sleeping} == {1}
    assert {reads.reads[keys.snapshot(sid)] for sid in sleeping} == {2}
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


async def test_an_index_lost_again_while_repair_runs_is_repaired_again(
    env: Env, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarts empty a second time near the end of a repair: what it rebuilt is
    gone, so it must not mark the index intact (the next full repair was an hour away,
    and meanwhile no wait resolved and no deadline fired)."""
    sid = await env.submit(doc="PR-T")
    await flush_index(redis_url, redis_prefix)
    index = env.services.index
    real = index.mark_intact
    lost = {"again": True}

    async def mark_intact(token: str) -> bool:
        if lost.pop("again", False):  # once: the walk is over, the mark not yet set
            await flush_index(redis_url, redis_prefix)
        return await real(token)

    monkeypatch.setattr(index, "mark_intact", mark_intact)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    report = await sweeper.sweep_once()
    assert report.repaired_waits == 1 and report.errors != []
    assert not await index.is_intact() and not await resolves_in_index(env, sid)
    report = await sweeper.sweep_once()  # the next sweep, not the next hour's
    assert report.repaired_waits == 1 and report.errors == []
    assert await index.is_intact() and await resolves_in_index(env, sid)


async def resolves_in_index(env: Env, sid: str) -> bool:
    wait = (await env.load(sid)).waits[0]
    found = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    return found is not None


async def repair_after_flush(env: Env, redis_url: str, redis_prefix: str) -> Reads:
    """Flush the index and repair it, the correlation records read and written through
    a store that counts what is written."""
    await flush_index(redis_url, redis_prefix)
    writes = Reads(env.services.store)
    env.services.correlations = ObjectCorrelations(writes)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.repair(env.clock.now(), SweepReport())
    return writes


async def resolves(env: Env, sid: str) -> bool:
    wait = (await env.load(sid)).waits[0]
    found = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), correlation_id=wait.correlation_id
    )
    by_key = await env.services.correlations.lookup_business_key(
        tenant="acme", business_key=wait.business_key or ""
    )
    by_id = await env.services.correlations.lookup(wait.correlation_id)
    return (
        found is not None
        and by_key is not None
        and by_key.correlation_id == wait.correlation_id
        and by_id is not None
        and by_id.session_id == sid
    )


async def test_repair_writes_nothing_for_a_wait_whose_request_went_out(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """Its durable record and business-key pointer were written before the request was
    sent: rewriting them cost two flushed writes a session (most of a repair's time)."""
    sleeping = [await env.submit(doc=f"PR-W{i}") for i in range(3)]
    await Sweeper(env.control).sweep_once()
    writes = await repair_after_flush(env, redis_url, redis_prefix)
    assert writes.written == []
    for sid in sleeping:
        assert await resolves(env, sid)


async def test_repair_records_a_wait_whose_suspend_died_before_binding(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """Committed, its request not yet sent, its record never written (the process died
    between the suspend's commit and its binding): repair writes the record and the
    pointer, and binds it."""
    sid = await env.submit(doc="PR-D")
    await Sweeper(env.control).sweep_once()
    snap = await env.load(sid)
    [wait] = snap.waits
    unsent = [
        e.model_copy(update={"status": DispatchStatus.PENDING, "dispatched_at": None})
        if e.correlation_id == wait.correlation_id
        else e
        for e in snap.outbox
    ]
    await env.services.snapshots.save(
        snap.model_copy(update={"outbox": unsent}), expected_generation=snap.generation
    )
    store = env.services.store
    for key in (
        keys.correlation(wait.correlation_id),
        keys.correlation_ref(sid, wait.correlation_id),
        keys.business_key("acme", "PR-D"),
    ):
        await store.delete(key)
    writes = await repair_after_flush(env, redis_url, redis_prefix)
    assert keys.correlation(wait.correlation_id) in writes.written
    assert keys.correlation_ref(sid, wait.correlation_id) in writes.written
    assert await resolves(env, sid)


async def test_repair_points_a_business_key_at_the_wait_the_index_gave_it_to(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """The pointer may name another wait, or none (its write lost): it follows the
    rebuilt index."""
    elsewhere, lost = await env.submit(doc="PR-E"), await env.submit(doc="PR-L")
    await Sweeper(env.control).sweep_once()
    store = env.services.store
    await store.put(keys.business_key("acme", "PR-E"), b"corr-of-another-wait")
    await store.delete(keys.business_key("acme", "PR-L"))
    writes = await repair_after_flush(env, redis_url, redis_prefix)
    assert sorted(k for k in writes.written if k.startswith("business-keys/")) == sorted(
        [keys.business_key("acme", "PR-E"), keys.business_key("acme", "PR-L")]
    )
    assert not any(k.startswith("correlations/") for k in writes.written)
    assert await resolves(env, elsewhere) and await resolves(env, lost)


async def test_repair_builds_no_whole_snapshot_of_a_sleeping_session(
    env: Env, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It reads the waits, outbox and processed events only: validating the conversation
    and tool log of every sleeping session was most of a repair's CPU."""
    sleeping = [await env.submit(doc=f"PR-P{i}") for i in range(3)]
    await Sweeper(env.control).sweep_once()

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("repair decoded a whole snapshot")

    monkeypatch.setattr(SnapshotCodec, "decode", whole)
    await repair_after_flush(env, redis_url, redis_prefix)
    monkeypatch.undo()
    for sid in sleeping:
        assert await resolves(env, sid)


@pytest.mark.parametrize("processed", [True, False])
async def test_repair_reads_a_long_sessions_sealed_processed_events(
    env: Env, redis_url: str, redis_prefix: str, processed: bool
) -> None:
    """An inbox event whose id was sealed into a history chunk is processed (no work
    owed); one that is not, is work, and the session is activated."""
    sid = await env.submit(doc="PR-C")
    await Sweeper(env.control).sweep_once()
    snap = await env.load(sid)
    event = callback(sid, snap.waits[0], event_id="evt-old", data={}, at=env.clock.now())
    await env.services.inbox.deliver(event)
    ids = [f"older-{i}" for i in range(300)]
    if processed:
        ids[3] = event.key  # sealed (the stored tail holds the last 2 x 64 at most)
    await env.services.snapshots.save(
        snap.model_copy(update={"processed_events": [*snap.processed_events, *ids]}),
        expected_generation=snap.generation,
    )
    stored = await env.services.snapshots.load_waiting(sid)
    assert stored.chunks.processed_events and event.key not in stored.processed_events
    await flush_index(redis_url, redis_prefix)
    activator = Recording()
    sweeper = Sweeper(SessionService(env.services, activator))  # type: ignore[arg-type]
    await sweeper.repair(env.clock.now(), SweepReport())
    assert ((sid, Reason.REPAIR) in activator.requests) is not processed


async def test_the_sweeps_read_a_due_sessions_waits_without_its_conversation(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll and an SLA deadline fall due, and the sweep acts on both though no whole
    snapshot can be decoded: it reads each due session's waits only (its conversation
    and tool log were most of the CPU of reading one)."""
    sid = await env.submit(doc="PR-T")
    activator = Recording()
    sweeper = Sweeper(SessionService(env.services, activator))  # type: ignore[arg-type]
    await sweeper.sweep_once(env.clock.now())
    [wait] = (await env.load(sid)).waits

    def whole(*args: object, **kwargs: object) -> None:
        raise AssertionError("a sweep decoded a whole snapshot")

    monkeypatch.setattr(SnapshotCodec, "decode", whole)
    await env.world.decide("PR-T", {"status": "approved"})
    env.clock.advance(2 * wait.expected_duration_s + 1)  # overdue: polled, and answered
    report = await sweeper.sweep_once(env.clock.now())
    assert (report.polls, report.poll_hits, report.errors) == (1, 1, [])
    polled = event_key(f"poll:{wait.tool_name}", f"poll:{wait.correlation_id}")
    assert await env.services.inbox.find(sid, polled) is not None
    env.clock.advance(3600)  # past its SLA deadline
    report = await sweeper.sweep_once(env.clock.now())
    assert report.timeouts == 1 and report.errors == []
    assert (sid, Reason.TIMEOUT) in activator.requests


async def test_repair_reports_a_sleeping_session_whose_snapshot_body_is_damaged(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """Its header still reads: the walk hands it over as a header, and repair names it
    among its errors (the others are repaired) rather than passing it over in silence."""
    damaged, sound = await env.submit(doc="PR-X"), await env.submit(doc="PR-Y")
    await Sweeper(env.control).sweep_once()
    store, codec = env.services.store, SnapshotCodec()
    data = (await store.get(keys.snapshot(damaged))).data
    await store.put(keys.snapshot(damaged), data[: codec.header_end(data)] + b"not zlib")
    await flush_index(redis_url, redis_prefix)
    report = SweepReport()
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.repair(env.clock.now(), report)
    assert [e for e in report.errors if damaged in e] and report.repaired_waits == 1
    assert await resolves(env, sound)


async def test_a_repair_that_cannot_read_an_inbox_fails_and_is_not_marked_done(
    env: Env, redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transient error is no per-session report: passed over, a session with an event
    waiting in its inbox would sleep on it until the next periodic repair, an hour on."""
    await env.submit(doc="PR-I")
    await Sweeper(env.control).sweep_once()
    await flush_index(redis_url, redis_prefix)

    async def unavailable(*args: object, **kwargs: object) -> None:
        raise StorageUnavailable("the store did not answer")

    monkeypatch.setattr(env.services.inbox, "pending", unavailable)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    with pytest.raises(StorageUnavailable):
        await sweeper.repair(env.clock.now(), SweepReport())
    assert not await env.services.index.is_intact()


async def test_repair_gives_a_pollable_wait_its_poll_timer_back(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """The poll timer went with the index: without it, a wait whose answer never comes
    would never be polled."""
    sid = await env.submit(doc="PR-Q")
    await Sweeper(env.control).sweep_once()
    await repair_after_flush(env, redis_url, redis_prefix)
    [wait] = (await env.load(sid)).waits
    env.clock.advance(2 * wait.expected_duration_s + 1)
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    report = await sweeper.sweep_once(env.clock.now())
    assert (report.polls, report.errors) == (1, [])


def redis_index(env: Env) -> RedisIndex:
    assert isinstance(env.services.index, RedisIndex)
    return env.services.index


async def test_repair_puts_back_what_a_partial_loss_took_from_a_bound_wait(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """Single keys lost (evicted, deleted), the wait's binding not among them: its SLA
    deadline entry, the deadline hour, its business-key pointer and its poll timer. The
    binding still resolves, so repair passed the wait over and none came back: the
    session was never polled, never timed out, and its business key answered nothing."""
    sid = await env.submit(doc="PR-P")
    await Sweeper(env.control).sweep_once()
    [wait] = (await env.load(sid)).waits
    index = redis_index(env)
    redis = index._redis
    hour = int(wait.deadline.timestamp()) // 3600
    bk_key, _ = index.keys.business_key("acme", "PR-P")
    lost = [
        index.keys.deadline_set(wait.correlation_id, hour),
        index.keys.deadline_hours,
        bk_key,
        index.keys.timers(TimerKind.POLL),
    ]
    assert await redis.delete(*lost) == len(lost)
    assert await resolves_in_index(env, sid)
    report = SweepReport()
    activator = Recording()
    sweeper = Sweeper(SessionService(env.services, activator))  # type: ignore[arg-type]
    await sweeper.repair(env.clock.now(), report)
    assert report.errors == []
    by_key = await index.resolve(tenant="acme", now=env.clock.now(), business_key="PR-P")
    assert by_key is not None and by_key.correlation_id == wait.correlation_id
    env.clock.advance(2 * wait.expected_duration_s + 1)  # overdue: polled
    report = await sweeper.sweep_once(env.clock.now())
    assert (report.polls, report.errors) == (1, [])
    env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
    report = await sweeper.sweep_once(env.clock.now())
    assert report.timeouts == 1 and (sid, Reason.TIMEOUT) in activator.requests


async def test_repair_leaves_a_backed_off_poll_where_it_is(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    """A wait polled (no answer yet) is polled next after a backoff. Its binding lost
    alone, repair bound it again and set a poll timer at the first poll's time beside the
    one backed off (the poll count in their names told them apart): a second chain of
    polls. A wait still bound has its poll timer made sure of now, which must not move it
    either."""
    sid = await env.submit(doc="PR-B")
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.sweep_once(env.clock.now())
    [wait] = (await env.load(sid)).waits
    env.clock.advance(2 * wait.expected_duration_s + 1)
    assert (await sweeper.sweep_once(env.clock.now())).polls == 1
    index = redis_index(env)
    polls = index.keys.timers(TimerKind.POLL)
    before = await index._redis.zrange(polls, 0, -1, withscores=True)
    assert len(before) == 1 and before[0][1] > to_ms(env.clock.now()), "backed off"
    await sweeper.repair(env.clock.now(), SweepReport())  # bound: made sure of
    assert await index._redis.zrange(polls, 0, -1, withscores=True) == before
    cid = wait.correlation_id
    assert await index._redis.hdel(index.keys.correlation(cid), cid) == 1
    report = SweepReport()
    await sweeper.repair(env.clock.now(), report)  # its binding lost: bound again
    assert report.repaired_waits == 1 and await resolves_in_index(env, sid)
    assert await index._redis.zrange(polls, 0, -1, withscores=True) == before
    assert (await sweeper.sweep_once(env.clock.now())).polls == 0


async def test_a_poll_timer_named_with_its_count_moves_on_under_the_waits_name(
    env: Env,
) -> None:
    """Entries an older build wrote carry the poll count (``sid|cid|n``): polled, then
    moved on as the wait's single entry (``sid|cid|0``), never kept beside it."""
    sid = await env.submit(doc="PR-N")
    sweeper = Sweeper(SessionService(env.services, Recording()))  # type: ignore[arg-type]
    await sweeper.sweep_once(env.clock.now())
    [wait] = (await env.load(sid)).waits
    index = env.services.index
    own = f"{sid}|{wait.correlation_id}|0"
    await index.unschedule(kind=TimerKind.POLL, member=own)
    older = f"{sid}|{wait.correlation_id}|3"
    await index.schedule(kind=TimerKind.POLL, member=older, at=wait.overdue_after)
    env.clock.advance(2 * wait.expected_duration_s + 1)
    assert (await sweeper.sweep_once(env.clock.now())).polls == 1
    later = env.clock.now() + timedelta(days=1)
    assert await index.due(kind=TimerKind.POLL, now=later, limit=10) == [own]


@pytest.mark.parametrize("flushed", [False, True], ids=["intact", "flushed"])
async def test_a_wait_overdue_by_more_than_the_grace_still_times_out(
    env: Env, redis_url: str, redis_prefix: str, flushed: bool
) -> None:
    """The reconciler was down for longer than the binding grace (7 days) past a wait's
    deadline, its index intact or flushed meanwhile. The binding had expired with the
    grace and repair bound it again as it was, expired already: the next deadline sweep
    dropped it, and the session never timed out."""
    sid = await env.submit(doc="PR-GAP")
    sweeper = Sweeper(env.control)
    await sweeper.sweep_once()
    env.clock.advance(8 * 24 * 3600.0)  # no sweep meanwhile
    if flushed:
        await flush_index(redis_url, redis_prefix)
    for _ in range(2):  # hourly: each sweep a whole repair too
        env.clock.advance(3601)
        await sweeper.sweep_once()
    assert (await env.load(sid)).state is SessionState.TIMED_OUT
