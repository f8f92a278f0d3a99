"""Leases with fencing tokens in Redis: a hash per lease, a counter per name, one expiry set.

One clock decides every lease: the Redis server's (``TIME`` inside each script). The
holders, the sweepers and the replicas that take, renew and recover leases run on many
hosts whose clocks disagree; if each compared expiry times with its own ``now``, a host
whose clock ran ahead would see a live lease as expired and take it over while its holder
still works (and one whose clock lags would keep a dead holder's session waiting). With
the server's clock, "expired" means the same thing to everyone. The ``now`` the port
passes is therefore ignored here; the embedded SQLite and in-memory indexes serve one
process (one clock) and keep using it. ``Lease.expires_at`` is in server time.

The relative Redis TTL on a lease hash only collects the record a day after it stops
mattering.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from storage.redis_index.connection import RedisConnection, ms, texts, translate
from torpor.clock import from_ms
from torpor.ports import Lease

LEASE_GC = 24 * 3600 * 1000  # keep an expired lease record a day, for post-mortems

# The server's clock in milliseconds, for every script below. Since Redis 5 scripts are
# replicated by their effects, so reading TIME before writing is allowed and replicas see
# the same values.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# A lease is free if absent or expired. The fencing counter only ever increases, so a
# stale holder's token is always smaller than the current one. An expired record still
# there was never released (a release deletes it): the third value says it was taken over.
# So does the lease's entry in the expiry set (a release removes it too) once the record's
# GC TTL has collected it: a holder that died before a day-long outage was still one that
# never released, and its successor must re-record the session's state.
# The counter is a key of its own and can be lost alone (evicted under an allkeys-*
# policy, deleted) while the record of an expired lease stays: INCR would then start again
# at 1, below the token its dead holder may still commit with. A counter behind the
# record's token is moved past it.
_ACQUIRE = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'exp', 'token')
local exp = tonumber(cur[1] or '0')
if exp > now then return nil end
local token = redis.call('INCR', KEYS[2])
local held = tonumber(cur[2] or '0')
if token <= held then
  token = held + 1
  redis.call('SET', KEYS[2], token)
end
local new_exp = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'exp', new_exp)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + tonumber(ARGV[4]))
local unreleased = exp > 0 or redis.call('ZSCORE', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[3], new_exp, ARGV[3])
return {token, new_exp, unreleased and 1 or 0}
"""
)

# Renewal needs only that the lease is still ours: a holder whose heartbeat came late but
# whom nobody replaced may go on (anyone who took over changed owner and token).
_RENEW = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return nil end
local new_exp = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'exp', new_exp)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[5]))
redis.call('ZADD', KEYS[2], new_exp, ARGV[4])
return new_exp
"""
)

# Like a renewal, but the lease is re-issued under a token above the counter, the fence
# the snapshot recorded (ARGV[3]) and the token it replaces (the counter may have been
# lost alone: see _ACQUIRE): the counter is raised with it, so it never again hands out a
# token at or below a fence that committed.
_RAISE = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return nil end
local counter = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = math.max(counter, tonumber(ARGV[3]), tonumber(cur[2])) + 1
redis.call('SET', KEYS[2], token)
local new_exp = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'token', token, 'exp', new_exp)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]) + tonumber(ARGV[6]))
redis.call('ZADD', KEYS[3], new_exp, ARGV[5])
return {token, new_exp}
"""
)

_RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""

_EXPIRED = (
    _NOW
    + """
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
"""
)

# Forgotten, a lease its holder never released is still one (as in the other indexes): if
# its record was collected, the expiry set's entry was the last sign of that, so a record
# of its expiry alone is written back (for the GC time again) before the entry goes, and
# the recovery that takes the lease next is told it took it over (_ACQUIRE).
_FORGET = (
    _NOW
    + """
local exp = tonumber(redis.call('HGET', KEYS[1], 'exp') or '0')
if exp > now then return 0 end
if exp == 0 then
  local was = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if was then
    redis.call('HSET', KEYS[1], 'exp', was)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
)


class RedisLeases(RedisConnection):
    @translate
    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None:
        got = await self.script(_ACQUIRE)(
            keys=[self.keys.lease(name), self.keys.fence(name), self.keys.lease_expiry],
            args=[owner, ms(ttl), name, LEASE_GC],
        )
        if got is None:
            return None
        token, expires, taken_over = got
        return Lease(name, owner, int(token), from_ms(int(expires)), taken_over=bool(taken_over))

    @translate
    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        expires = await self.script(_RENEW)(
            keys=[self.keys.lease(lease.name), self.keys.lease_expiry],
            args=[lease.owner, lease.token, ms(ttl), lease.name, LEASE_GC],
        )
        if expires is None:
            return None
        return Lease(lease.name, lease.owner, lease.token, from_ms(int(expires)))

    @translate
    async def raise_fence(
        self, lease: Lease, *, floor: int, ttl: timedelta, now: datetime
    ) -> Lease | None:
        name = lease.name
        got = await self.script(_RAISE)(
            keys=[self.keys.lease(name), self.keys.fence(name), self.keys.lease_expiry],
            args=[lease.owner, lease.token, floor, ms(ttl), name, LEASE_GC],
        )
        if got is None:
            return None
        token, expires = got
        return Lease(name, lease.owner, int(token), from_ms(int(expires)))

    @translate
    async def release_lease(self, lease: Lease) -> bool:
        released = await self.script(_RELEASE)(
            keys=[self.keys.lease(lease.name), self.keys.lease_expiry],
            args=[lease.owner, lease.token, lease.name],
        )
        return bool(released)

    @translate
    async def expired_leases(self, *, now: datetime, limit: int) -> list[str]:
        return texts(await self.script(_EXPIRED)(keys=[self.keys.lease_expiry], args=[limit]))

    @translate
    async def drop_lease(self, *, name: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.keys.lease(name), self.keys.fence(name))
        pipe.zrem(self.keys.lease_expiry, name)
        await pipe.execute()

    @translate
    async def forget_lease(self, *, name: str, now: datetime) -> None:
        keys = [self.keys.lease(name), self.keys.lease_expiry]
        await self.script(_FORGET)(keys=keys, args=[name, LEASE_GC])
