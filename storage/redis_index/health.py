"""Reachability, shutdown and the integrity marker of the Redis index."""

from __future__ import annotations

from storage.redis_index.connection import RedisConnection, translate


class RedisHealth(RedisConnection):
    @translate
    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    @translate
    async def mark_intact(self) -> None:
        # A flushed or replaced Redis loses this key: the reconciler then rebuilds.
        await self._redis.set(self.keys.intact, "1")

    @translate
    async def is_intact(self) -> bool:
        return bool(await self._redis.exists(self.keys.intact))
