"""The lease heartbeat: renews with the clock's now, notices a lost lease, stops cleanly.

It runs against the embedded SQLite index (a real adapter, no Redis) with a ManualClock,
so lease expiry follows the test's time, not the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from storage.sqlite_index import SqliteIndex
from tests.conftest import eventually
from tests.support.factories import NOW
from torpor.clock import ManualClock
from torpor.errors import IndexUnavailable, LeaseLost
from torpor.ports import Lease
from torpor.session.heartbeat import Heartbeat

PERIOD = timedelta(milliseconds=5)
TTL = timedelta(seconds=45)
NAME = "session:s_1"


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` to hold, failing after 5 s (the shared helper, polled fast)."""
    await eventually(condition, timeout_s=5.0, interval_s=0.001)


def beats(lease: Lease) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == f"heartbeat:{lease.name}"]


async def take(index: SqliteIndex, clock: ManualClock, owner: str = "host-a") -> Lease:
    lease = await index.acquire_lease(name=NAME, owner=owner, ttl=TTL, now=clock.now())
    assert lease is not None
    return lease


async def test_renews_the_lease_from_the_clocks_now(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    clock.advance(30)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    try:
        await until(lambda: heartbeat.lease.expires_at == NOW + timedelta(seconds=30) + TTL)
        assert not heartbeat.lost and heartbeat.lease.token == lease.token
        # The index holds the renewed expiry: past the first TTL the lease is still live.
        assert await sqlite_index.expired_leases(now=NOW + TTL, limit=10) == []
        after = NOW + timedelta(seconds=30) + TTL
        assert await sqlite_index.expired_leases(now=after, limit=10) == [NAME]
    finally:
        await heartbeat.stop()


async def test_a_lease_taken_over_is_noticed_as_lost(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    clock.advance(TTL.total_seconds() + 1)  # the holder missed its heartbeats
    thief = await take(sqlite_index, clock, owner="host-b")
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    try:
        await until(lambda: heartbeat.lost)
        await until(lambda: not beats(lease))  # it stops renewing once lost
        assert heartbeat.lease == lease  # never adopts someone else's lease
        # The new holder's lease is untouched by the old holder's attempts.
        assert await sqlite_index.renew_lease(thief, ttl=TTL, now=clock.now()) is not None
    finally:
        await heartbeat.stop()


async def test_a_released_lease_is_noticed_as_lost(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    assert await sqlite_index.release_lease(lease)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    try:
        await until(lambda: heartbeat.lost)
    finally:
        await heartbeat.stop()


class FlakyIndex:
    """The SQLite index, unreachable for its first ``failures`` renewals."""

    def __init__(self, index: SqliteIndex, failures: int) -> None:
        self.index = index
        self.failures = failures
        self.calls = 0

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        self.calls += 1
        if self.calls <= self.failures:
            raise IndexUnavailable("index down")
        return await self.index.renew_lease(lease, ttl=ttl, now=now)


async def test_an_unreachable_index_is_retried_not_taken_as_loss(
    sqlite_index: SqliteIndex,
) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    clock.advance(10)
    flaky = FlakyIndex(sqlite_index, failures=2)
    heartbeat = Heartbeat(flaky, lease, clock=clock, period=PERIOD, ttl=TTL).start()  # type: ignore[arg-type]
    try:
        await until(lambda: heartbeat.lease.expires_at == NOW + timedelta(seconds=10) + TTL)
        assert flaky.calls == 3 and not heartbeat.lost
    finally:
        await heartbeat.stop()


async def test_stop_ends_the_renewals(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    assert len(beats(lease)) == 1
    await heartbeat.stop()
    assert beats(lease) == []
    await heartbeat.stop()  # stopping twice is harmless
    assert not heartbeat.lost


async def test_stop_before_start_is_harmless(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    await Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).stop()


async def test_refence_moves_the_token_above_the_floor_and_keeps_renewing(
    sqlite_index: SqliteIndex,
) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    try:
        await heartbeat.refence(lease.token + 5)  # the snapshot's fence, after a flush
        assert heartbeat.lease.token == lease.token + 6 and not heartbeat.lost
        assert len(beats(lease)) == 1  # one renewal task, not two
        clock.advance(10)
        await until(lambda: heartbeat.lease.expires_at == NOW + timedelta(seconds=10) + TTL)
        assert not heartbeat.lost and heartbeat.lease.token == lease.token + 6
    finally:
        await heartbeat.stop()


async def test_refence_of_a_lease_taken_over_is_lease_lost(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    clock.advance(TTL.total_seconds() + 1)
    thief = await take(sqlite_index, clock, owner="host-b")
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()
    try:
        with pytest.raises(LeaseLost):
            await heartbeat.refence(thief.token)
        assert heartbeat.lost and beats(lease) == []
        assert await sqlite_index.renew_lease(thief, ttl=TTL, now=clock.now()) is not None
    finally:
        await heartbeat.stop()


class CancelLostInTheClient:
    """A lease index whose renewal does not let a cancel through: it swallows one that
    lands as the call completes (``swallow``, as Python 3.11's asyncio.wait_for does, which
    redis-py writes under: gh-86296), or reports it as a lost connection (as a client
    whose read was cancelled can)."""

    def __init__(self, *, swallow: bool) -> None:
        self.swallow = swallow
        self.calls = 0
        self.in_call = asyncio.Event()

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        self.calls += 1
        self.in_call.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not self.swallow:
                raise IndexUnavailable("connection closed while reading") from None
        return lease


@pytest.mark.parametrize("swallow", [True, False], ids=["swallowed", "as-lost-connection"])
async def test_a_stop_whose_cancel_the_client_loses_still_stops(
    sqlite_index: SqliteIndex, swallow: bool
) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    index = CancelLostInTheClient(swallow=swallow)
    heartbeat = Heartbeat(index, lease, clock=clock, period=PERIOD, ttl=TTL).start()  # type: ignore[arg-type]
    await asyncio.wait_for(index.in_call.wait(), timeout=5)
    stopping = asyncio.ensure_future(heartbeat.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert stopping in done, "stop() never returned: the heartbeat swallowed its cancel"
    assert beats(lease) == [] and index.calls == 1


async def test_a_cancel_of_the_caller_of_stop_is_not_swallowed(sqlite_index: SqliteIndex) -> None:
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()

    async def stop_then_go_on() -> str:
        await heartbeat.stop()
        return "went on"

    stopper = asyncio.ensure_future(stop_then_go_on())
    await asyncio.sleep(0)  # stop() is now waiting for the heartbeat's end
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper


async def test_a_caller_that_swallowed_an_earlier_cancel_still_stops_cleanly(
    sqlite_index: SqliteIndex,
) -> None:
    # Its task's cancelling() count stays above 0 (gh-86296 leaves it so): stop() must not
    # take the heartbeat's own end for a cancel of the caller, or the lease is never
    # released and the session waits out its TTL.
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    heartbeat = Heartbeat(sqlite_index, lease, clock=clock, period=PERIOD, ttl=TTL).start()

    async def caller() -> str:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        await heartbeat.stop()
        return "stopped"

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "stopped"
    assert beats(lease) == []


async def test_an_index_out_of_reach_for_a_whole_ttl_is_a_lost_lease(
    sqlite_index: SqliteIndex,
) -> None:
    """Cut off from the index past the lease's TTL, the holder went on renewing in vain
    and calling tools, while the reconciler recovered the session elsewhere: each tool
    call of the last step ran twice. From a TTL after its last renewal it is lost (on the
    process's steady clock: the index's or a test's clock jumping is no lapse)."""
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    down = FlakyIndex(sqlite_index, failures=1_000_000)
    steady = [100.0]  # this process's steady clock, in seconds
    heartbeat = Heartbeat(
        down,  # type: ignore[arg-type]
        lease,
        clock=clock,
        period=PERIOD,
        ttl=TTL,
        elapsed=lambda: steady[0],
    ).start()
    try:
        steady[0] += TTL.total_seconds() - 1
        await until(lambda: down.calls >= 3)
        assert not heartbeat.lapsed() and not heartbeat.lost  # still within its TTL
        steady[0] += 1
        assert heartbeat.lapsed()  # asked before a tool call: no renewal needed to know
        await until(lambda: not beats(lease))  # and the renewals end
        assert heartbeat.lost
    finally:
        await heartbeat.stop()


async def test_renewals_that_were_only_late_are_no_lapse(sqlite_index: SqliteIndex) -> None:
    """A loop too busy to renew for a while (a loaded host) has not lost its lease by
    that alone: its next renewal says whether the lease is still its own."""
    clock = ManualClock(NOW)
    lease = await take(sqlite_index, clock)
    steady = [100.0]
    heartbeat = Heartbeat(
        sqlite_index, lease, clock=clock, period=timedelta(hours=1), ttl=TTL,
        elapsed=lambda: steady[0],
    )  # fmt: skip
    steady[0] += TTL.total_seconds() + 1
    assert not heartbeat.lapsed() and not heartbeat.lost
