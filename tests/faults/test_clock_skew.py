"""Clocks skewed per process: lease decisions follow the Redis server's clock only.

Two "processes" are two ``RedisIndex`` clients on one index, each handing the index its
own idea of ``now``. Before leases used the server's clock, the one whose clock ran ahead
saw a live lease as expired and took it over, and one whose clock lagged left a dead
holder's session alone for as long as it lagged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from storage.redis_index import RedisIndex

SKEW = timedelta(hours=1)


@pytest.fixture
async def two_processes(redis_url: str, redis_prefix: str) -> AsyncIterator[tuple[RedisIndex, ...]]:
    first, second = (
        RedisIndex(redis_url, prefix=redis_prefix),
        RedisIndex(redis_url, prefix=redis_prefix),
    )
    yield first, second
    await first.close()
    await second.close()


def wall() -> datetime:
    return datetime.now(UTC)


async def server_passed(index: RedisIndex, at: datetime, *, limit_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        seconds, micros = await index.client.time()
        if datetime.fromtimestamp(seconds + micros / 1e6, UTC) > at:
            return
        assert asyncio.get_running_loop().time() < deadline, "the server clock stood still"
        await asyncio.sleep(0.01)


async def test_a_process_whose_clock_runs_ahead_cannot_steal_a_live_lease(
    two_processes: tuple[RedisIndex, RedisIndex],
) -> None:
    holder, skewed = two_processes
    ttl = timedelta(seconds=30)
    lease = await holder.acquire_lease(name="session:s", owner="holder", ttl=ttl, now=wall())
    assert lease is not None
    ahead = wall() + SKEW
    assert await skewed.acquire_lease(name="session:s", owner="thief", ttl=ttl, now=ahead) is None
    # ...nor does its sweeper take the live lease for a dead holder's.
    assert await skewed.expired_leases(now=ahead, limit=10) == []
    await skewed.forget_lease(name="session:s", now=ahead)
    # The holder, whose clock lags by as much, still renews and keeps it.
    renewed = await holder.renew_lease(lease, ttl=ttl, now=wall() - SKEW)
    assert renewed is not None and renewed.token == lease.token
    assert await skewed.acquire_lease(name="session:s", owner="thief", ttl=ttl, now=ahead) is None


async def test_a_process_whose_clock_lags_still_recovers_a_dead_holder(
    two_processes: tuple[RedisIndex, RedisIndex],
) -> None:
    dead, lagging = two_processes
    ttl = timedelta(milliseconds=200)
    lease = await dead.acquire_lease(name="session:d", owner="dead", ttl=ttl, now=wall())
    assert lease is not None
    await server_passed(lagging, lease.expires_at)
    behind = wall() - SKEW
    assert await lagging.expired_leases(now=behind, limit=10) == ["session:d"]
    taken = await lagging.acquire_lease(name="session:d", owner="sweeper", ttl=ttl, now=behind)
    assert taken is not None and taken.token > lease.token
