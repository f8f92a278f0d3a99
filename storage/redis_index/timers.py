"""Timers in Redis: one sorted set per kind, scored by due time in ms."""

from __future__ import annotations

from datetime import datetime

from storage.redis_index.connection import RedisConnection, texts, translate
from torpor.clock import to_ms
from torpor.ports import TimerKind

# Take due members and push them to ARGV[3] in one step: two takers never both get one.
_LEASE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, member in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[3], member) end
return due
"""

# Remove a member only if nobody moved it since it was leased at ARGV[2].
_UNSCHEDULE_IF = """
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


class RedisTimers(RedisConnection):
    @translate
    async def schedule(
        self,
        *,
        kind: TimerKind,
        member: str,
        at: datetime,
        keep_earlier: bool = False,
        if_absent: bool = False,
    ) -> None:
        # ZADD LT adds a missing member and only ever lowers an existing score; ZADD NX
        # only adds. Batched: every accepted webhook arms one (its session's wake timer).
        if keep_earlier and if_absent:
            raise ValueError("keep_earlier and if_absent exclude each other")
        order = ("LT",) if keep_earlier else ("NX",) if if_absent else ()
        await self.batched("ZADD", self.keys.timers(kind), *order, to_ms(at), member)

    @translate
    async def unschedule(
        self, *, kind: TimerKind, member: str, if_at: datetime | None = None
    ) -> None:
        if if_at is None:
            # Batched: every activation unschedules its wake-up before looking at its inbox.
            await self.batched("ZREM", self.keys.timers(kind), member)
            return
        await self.script(_UNSCHEDULE_IF)(
            keys=[self.keys.timers(kind)], args=[member, to_ms(if_at)]
        )

    @translate
    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        return texts(
            await self._redis.zrangebyscore(
                self.keys.timers(kind), "-inf", to_ms(now), start=0, num=limit
            )
        )

    @translate
    async def lease_due(
        self, *, kind: TimerKind, now: datetime, limit: int, until: datetime
    ) -> list[str]:
        return texts(
            await self.script(_LEASE_DUE)(
                keys=[self.keys.timers(kind)], args=[to_ms(now), limit, to_ms(until)]
            )
        )
