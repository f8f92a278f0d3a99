"""Running slots in Redis: one sorted set of slot leases per scope, one queue per batch.

``slot:m`` maps a member to ``queue<TAB>rank<TAB>scope...``; ``slot:cap`` a scope to its
cap; ``slot:s:<scope>`` holds the live slots scored by expiry (server time, as leases:
``leases.py`` says why); ``slot:q:<queue>`` the members waiting, scored by rank (document
order), and ``slot:q:<scope>`` those waiting for that full scope: a tenant's slot given
back wakes every batch of the tenant waiting for one, not only the leaver's own. Taking
the slots of every scope, or queueing, is one script: two replicas admitting at once can
never both take the last slot.
"""

from __future__ import annotations

from datetime import timedelta

import redis.asyncio as aioredis

from storage.redis_index.connection import RedisConnection, ms, texts, translate
from torpor.ports import SlotEntry, SlotUsage

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function fields(rec)
  local out = {}
  for part in string.gmatch(rec, '[^\\t]+') do table.insert(out, part) end
  return out
end
"""

# KEYS: members, caps. ARGV: member, ttl ms, key prefix. Slot keys are built here from
# the member's record (one Redis, not a cluster: the index's other scripts assume it too).
_ENTER = (
    _NOW
    + """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then return 'uncapped' end
local f = fields(rec)
for i = 3, #f do
  local key = ARGV[3] .. 's:' .. f[i]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if not redis.call('ZSCORE', key, ARGV[1]) then
    local cap = tonumber(redis.call('HGET', KEYS[2], f[i]) or '0')
    if redis.call('ZCARD', key) >= cap then
      redis.call('ZADD', ARGV[3] .. 'q:' .. f[1], 'NX', f[2], ARGV[1])
      redis.call('ZADD', ARGV[3] .. 'q:' .. f[i], 'NX', f[2], ARGV[1])
      return 'waiting'
    end
  end
end
for i = 3, #f do
  redis.call('ZADD', ARGV[3] .. 's:' .. f[i], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('ZREM', ARGV[3] .. 'q:' .. f[i], ARGV[1])
end
redis.call('ZREM', ARGV[3] .. 'q:' .. f[1], ARGV[1])
return 'admitted'
"""
)

# KEYS: members. ARGV: member, forget (0/1), key prefix, limit.
_LEAVE = (
    _NOW
    + """
local rec = redis.call('HGET', KEYS[1], ARGV[1])
if not rec then return {} end
local f = fields(rec)
for i = 3, #f do redis.call('ZREM', ARGV[3] .. 's:' .. f[i], ARGV[1]) end
local q = ARGV[3] .. 'q:' .. f[1]
if ARGV[2] == '1' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', q, ARGV[1])
  for i = 3, #f do redis.call('ZREM', ARGV[3] .. 'q:' .. f[i], ARGV[1]) end
end
local heads = redis.call('ZRANGE', q, 0, tonumber(ARGV[4]) - 1)
for i = 3, #f do
  local sq = ARGV[3] .. 'q:' .. f[i]
  if sq ~= q then
    for _, m in ipairs(redis.call('ZRANGE', sq, 0, tonumber(ARGV[4]) - 1)) do
      table.insert(heads, m)
    end
  end
end
return heads
"""
)

_USAGE = (
    _NOW
    + """
return {redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf'), redis.call('ZCARD', KEYS[2])}
"""
)

REGISTER_CHUNK = 1000


class RedisSlots(RedisConnection):
    """``RunningSlots`` on the index's own Redis client (``client=``)."""

    def __init__(self, url: str, *, prefix: str, client: aioredis.Redis | None = None) -> None:
        super().__init__(url, prefix=prefix, client=client)
        self._owns_client = client is None
        self._base = f"{prefix}slot:"

    @translate
    async def register(
        self, *, members: dict[str, int], scopes: dict[str, int], queue: str
    ) -> None:
        await self._redis.hset(
            self._base + "cap", mapping={scope: str(cap) for scope, cap in scopes.items()}
        )
        tail = "\t".join(scopes)
        items = list(members.items())
        for start in range(0, len(items), REGISTER_CHUNK):
            chunk = items[start : start + REGISTER_CHUNK]
            await self._redis.hset(
                self._base + "m",
                mapping={member: f"{queue}\t{rank}\t{tail}" for member, rank in chunk},
            )

    @translate
    async def enter(self, *, member: str, ttl: timedelta) -> SlotEntry:
        answer = await self.script(_ENTER)(
            keys=[self._base + "m", self._base + "cap"], args=[member, ms(ttl), self._base]
        )
        return SlotEntry(answer)

    @translate
    async def leave(self, *, member: str, forget: bool, limit: int) -> list[str]:
        heads = await self.script(_LEAVE)(
            keys=[self._base + "m"], args=[member, int(forget), self._base, max(1, limit)]
        )
        return list(dict.fromkeys(texts(heads))) if limit > 0 else []

    @translate
    async def usage(self, *, scope: str, queue: str | None = None) -> SlotUsage:
        running, waiting = await self.script(_USAGE)(
            keys=[self._base + "s:" + scope, self._base + "q:" + (queue or scope)], args=[]
        )
        return SlotUsage(int(running), int(waiting))

    async def close(self) -> None:
        self._pipelined.close()  # its own lean connection, whoever owns the client
        if self._owns_client:
            await self._redis.aclose()
