"""bench/bench_scale.py's synthetic writer binds a million waits by pipelining the
index's own bind script: what it leaves in Redis must be exactly what ``bind_wait``
leaves, or the bench measures bytes the product never writes (its arguments fell behind
the script once, and the bench failed with a Lua error at the first batch)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis

from bench import bench_scale
from storage.redis_index import RedisIndex


def contents(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Every key under ``prefix`` (named without it) with its value."""
    found: dict[str, Any] = {}
    for raw in client.scan_iter(match=prefix + "*", count=1000):
        key = raw.decode()
        kind = client.type(key).decode()
        if kind == "hash":
            value: Any = client.hgetall(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            value = (kind, client.dump(key))
        found[key.removeprefix(prefix)] = value
    return found


async def test_the_bulk_writer_leaves_what_bind_wait_leaves(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_scale, "REDIS", redis_url)
    bulk = RedisIndex(redis_url, prefix=f"{redis_prefix}bulk:", buckets=16)
    one = RedisIndex(redis_url, prefix=f"{redis_prefix}one:", buckets=16)
    now = datetime.now(UTC)
    bound = bench_scale.waits(40, now + timedelta(hours=1), spread_s=7200)
    try:
        bench_scale.bind_pipelined(bulk, bound, now=now)
        for i, binding in enumerate(bound):
            assert await one.bind_wait(
                binding, business_key=f"PR-{i:07d}", grace=timedelta(days=7), now=now
            )
        client = redis.Redis.from_url(redis_url)
        try:
            written = contents(client, f"{redis_prefix}bulk:")
            assert written and written == contents(client, f"{redis_prefix}one:")
        finally:
            client.close()
        # And the index reads it back: by correlation id and by business key.
        first = bound[0]
        assert await bulk.resolve(tenant="acme", now=now, correlation_id=first.correlation_id)
        assert await bulk.resolve(tenant="acme", now=now, business_key="PR-0000000")
    finally:
        await bulk.close()
        await one.close()
