"""Reachability, shutdown and the integrity marker of the Redis index."""

from __future__ import annotations

from datetime import datetime

from storage.redis_index.connection import RedisConnection, opt_text, translate
from torpor.clock import from_ms, to_ms


class RedisHealth(RedisConnection):
    @translate
    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        self._pipelined.close()
        await self._redis.aclose()

    @translate
    async def mark_intact(self) -> None:
        # A flushed or replaced Redis loses this key: the reconciler then rebuilds.
        await self._redis.set(self.keys.intact, "1")

    @translate
    async def is_intact(self) -> bool:
        return bool(await self._redis.exists(self.keys.intact))

    @translate
    async def record_sweep(self, *, at: datetime) -> None:
        await self._redis.set(self.keys.last_sweep, to_ms(at))

    @translate
    async def last_sweep(self) -> datetime | None:
        found = opt_text(await self._redis.get(self.keys.last_sweep))
        return None if found is None else from_ms(int(found))
