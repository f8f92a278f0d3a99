"""Replay nonces and idempotency keys in Redis: first claim wins, Redis TTLs forget them.

Both expire by a relative Redis TTL (server-side), so the caller's ``now`` is not needed
to decide their expiry here; it only decides whether the resolved wait is still live.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from storage.redis_index.connection import RedisConnection, ms, opt_text, translate
from storage.redis_index.waits import live, pointed
from torpor.ports import Admission, IdempotencyRecord, IdempotencyStatus

# The whole admission of a webhook in one script, so one round trip: the server's clock
# (shared by every replica), the claims all or none (a replay must not consume one claim
# of a pair and fail on the other), and, if they were free, the routing
# entry. (A pipeline holding a script costs a second trip: redis-py checks SCRIPT EXISTS
# before every pipelined EVALSHA.) ARGV: TTL ms, number of claim keys, routing field; the
# routing hash, if any, is the last key.
_ADMIT = """
local now = redis.call('TIME')
local n = tonumber(ARGV[2])
for i = 1, n do
  if redis.call('EXISTS', KEYS[i]) == 1 then return {now[1], now[2], 0, false} end
end
for i = 1, n do redis.call('SET', KEYS[i], '1', 'PX', ARGV[1]) end
local found = false
if #KEYS > n then found = redis.call('HGET', KEYS[n + 1], ARGV[3]) end
return {now[1], now[2], 1, found}
"""

_CLAIM_IDEMPOTENCY = """
local cur = redis.call('HMGET', KEYS[1], 'sid', 'fp', 'st')
if cur[1] then return {0, cur[1], cur[2], cur[3]} end
redis.call('HSET', KEYS[1], 'sid', ARGV[1], 'fp', ARGV[2], 'st', 'in_progress')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, ARGV[1], ARGV[2], 'in_progress'}
"""


class RedisClaims(RedisConnection):
    @translate
    async def admit(
        self,
        *,
        claims: list[tuple[str, str]],
        ttl: timedelta,
        now: datetime,
        tenant: str,
        correlation_id: str | None,
        business_key: str | None,
    ) -> Admission:
        keys = [self.keys.nonce(scope, nonce) for scope, nonce in claims]
        field = ""
        if correlation_id is not None:
            keys.append(self.keys.correlation(correlation_id))
            field = correlation_id
        elif business_key is not None:
            route, field = self.keys.business_key(tenant, business_key)
            keys.append(route)
        seconds, micros, fresh, raw = await self.batched_script(
            _ADMIT, keys=keys, args=[ms(ttl), len(claims), field]
        )
        at = datetime.fromtimestamp(int(seconds) + int(micros) / 1e6, tz=UTC)
        if not fresh:
            return Admission(False, None, at)
        found = opt_text(raw)
        if correlation_id is None:
            found = pointed(found)
        if found is None:
            return Admission(True, None, at)
        if correlation_id is None:  # a business key gave us the correlation id: one hop more
            raw = opt_text(await self._redis.hget(self.keys.correlation(found), found))
            return Admission(True, live(found, raw, tenant=tenant, now=now), at)
        return Admission(True, live(correlation_id, found, tenant=tenant, now=now), at)

    @translate
    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        await self._redis.delete(self.keys.nonce(scope, nonce))

    @translate
    async def holds_nonce(self, *, scope: str, nonce: str, now: datetime) -> bool:
        return bool(await self._redis.exists(self.keys.nonce(scope, nonce)))

    @translate
    async def claim_idempotency(
        self,
        *,
        tenant: str,
        key: str,
        fingerprint: str,
        session_id: str,
        ttl: timedelta,
        now: datetime,
    ) -> IdempotencyRecord:
        created, sid, fp, status = await self.script(_CLAIM_IDEMPOTENCY)(
            keys=[self.keys.idempotency(tenant, key)], args=[session_id, fingerprint, ms(ttl)]
        )
        return IdempotencyRecord(key, sid, fp, IdempotencyStatus(status), bool(created))

    @translate
    async def finish_idempotency(
        self, *, tenant: str, key: str, ttl: timedelta, now: datetime
    ) -> None:
        name = self.keys.idempotency(tenant, key)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(name, "st", IdempotencyStatus.DONE.value)
            pipe.pexpire(name, ms(ttl))
            await pipe.execute()

    @translate
    async def release_idempotency(self, *, tenant: str, key: str) -> None:
        await self._redis.delete(self.keys.idempotency(tenant, key))
