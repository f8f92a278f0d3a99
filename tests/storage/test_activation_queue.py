"""Activation requests to pool hosts through Redis: what goes in comes out whole and in
order, a host blocked on its channel wakes as soon as a request lands, a channel nobody
takes from stays bounded, and a line this version cannot read is dropped, not fatal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis

from storage.redis_index import queue as queue_module
from storage.redis_index.queue import RedisActivationQueue
from tests.conftest import eventually
from torpor.ports import Reason, Wanted


@pytest.fixture
async def queue(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisActivationQueue]:
    made = RedisActivationQueue(redis_url, prefix=redis_prefix)
    yield made
    await made.close()
    await made.client.aclose()


async def test_requests_come_out_whole_and_in_order(queue: RedisActivationQueue) -> None:
    first = Wanted(
        "s_1", Reason.EVENT, 1796110920.123456, "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    )
    second = Wanted("s_2", Reason.RECOVER, 1796110921.5)
    assert await queue.push("pool.ns.0", first) == 1
    assert await queue.push("pool.ns.0", second) == 2
    assert await queue.pop("pool.ns.0", wait_s=1) == [first]
    assert await queue.pop("pool.ns.0", wait_s=1) == [second]


async def test_a_waiting_host_wakes_when_a_request_lands(queue: RedisActivationQueue) -> None:
    wanted = Wanted("s_3", Reason.EVENT, time.time())
    blocked = (await queue.client.info("clients"))["blocked_clients"]
    popping = asyncio.create_task(queue.pop("pool.ns.1", wait_s=2))

    async def waiting() -> bool:  # the pop is blocked in Redis
        return (await queue.client.info("clients"))["blocked_clients"] > blocked

    await eventually(waiting, timeout_s=1, interval_s=0.01, what="the pop blocks")
    assert not popping.done()
    pushed = time.perf_counter()
    await queue.push("pool.ns.1", wanted)
    assert await popping == [wanted]
    assert time.perf_counter() - pushed < 0.5  # woken by the push, not by its timeout


async def test_channels_are_apart_and_an_empty_one_times_out(queue: RedisActivationQueue) -> None:
    await queue.push("pool.ns.2", Wanted("s_4", Reason.EVENT, 1.0))
    assert await queue.pop("pool.other.2", wait_s=1) == []
    assert [w.session_id for w in await queue.pop("pool.ns.2", wait_s=1)] == ["s_4"]


async def test_a_channel_nobody_takes_from_keeps_only_the_newest(
    queue: RedisActivationQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue_module, "MAX_WAITING", 3)
    counts = [await queue.push("pool.ns.3", Wanted(f"s_{i}", Reason.EVENT, 1.0)) for i in range(5)]
    assert counts == [1, 2, 3, 3, 3]
    left = [(await queue.pop("pool.ns.3", wait_s=1))[0].session_id for _ in range(3)]
    assert left == ["s_2", "s_3", "s_4"]


async def test_an_unreadable_request_is_dropped(
    queue: RedisActivationQueue, redis_url: str, redis_prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.rpush(queue.keys.activations("pool.ns.4"), "not a request")
    client.close()
    assert await queue.pop("pool.ns.4", wait_s=1) == []
    await queue.push("pool.ns.4", Wanted("s_5", Reason.EVENT, 1.0))
    assert [w.session_id for w in await queue.pop("pool.ns.4", wait_s=1)] == ["s_5"]
