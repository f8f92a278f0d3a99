"""Timers in Redis: one sorted set per kind, scored by due time in ms."""

from __future__ import annotations

from datetime import datetime

from storage.redis_index.connection import RedisConnection, texts, translate
from torpor.clock import to_ms
from torpor.ports import TimerKind


class RedisTimers(RedisConnection):
    @translate
    async def schedule(self, *, kind: TimerKind, member: str, at: datetime) -> None:
        await self._redis.zadd(self.keys.timers(kind), {member: to_ms(at)})

    @translate
    async def unschedule(self, *, kind: TimerKind, member: str) -> None:
        await self._redis.zrem(self.keys.timers(kind), member)

    @translate
    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        return texts(
            await self._redis.zrangebyscore(
                self.keys.timers(kind), "-inf", to_ms(now), start=0, num=limit
            )
        )
