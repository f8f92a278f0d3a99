"""Reachability, shutdown and the integrity marker of the Redis index."""

from __future__ import annotations

import secrets
from datetime import datetime

from storage.redis_index.connection import RedisConnection, opt_text, translate
from torpor.clock import from_ms, to_ms

# Intact only if the repair's note is still there: a flush during the repair took it.
_MARK_INTACT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], '1')
redis.call('DEL', KEYS[1])
return 1
"""


class RedisHealth(RedisConnection):
    @translate
    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        self._pipelined.close()
        await self._redis.aclose()

    @translate
    async def begin_repair(self) -> str:
        token = secrets.token_hex(8)
        await self._redis.set(self.keys.repairing, token)
        return token

    @translate
    async def mark_intact(self, token: str) -> bool:
        # A flushed or replaced Redis loses this key: the reconciler then rebuilds.
        marked = await self.script(_MARK_INTACT)(
            keys=[self.keys.repairing, self.keys.intact], args=[token]
        )
        return bool(marked)

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
