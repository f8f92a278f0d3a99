"""``redis://``: the index for clusters (redis-py asyncio).

Every multi-key change is one MULTI/EXEC or one Lua script, so a reader never sees half
of it. Logical time (lease expiry, deadlines) is passed in by the caller; Redis TTLs are
used only to garbage-collect entries well after they stop mattering.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from datetime import datetime, timedelta
from functools import wraps
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.bindings import StoredBinding, decode_binding, encode_binding
from storage.keys import RedisKeys
from torpor.clock import from_ms, to_ms
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState
from torpor.ports import (
    Admission,
    IdempotencyRecord,
    IdempotencyStatus,
    Lease,
    SessionPage,
    TimerKind,
    WaitBinding,
)

P = ParamSpec("P")
T = TypeVar("T")

LEASE_GC = 24 * 3600 * 1000  # keep an expired lease record a day, for post-mortems

# A wait is three entries: a field in a correlation hash bucket, a business-key pointer in
# a hash bucket, and a member of one shard of its deadline hour's sorted sets (the hour is
# listed in an hour index). Buckets keep each structure small enough for Redis' compact
# listpack encoding. Hash fields cannot carry a TTL before Redis 7.4, so each entry holds
# its own expiry (deadline + grace) and each bucket key expires with its latest entry.
_BIND = """
local function extend(key, at)
  if redis.call('PEXPIRETIME', key) < tonumber(at) then redis.call('PEXPIREAT', key, at) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
extend(KEYS[1], ARGV[6])
if KEYS[2] ~= '' then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[1])
  extend(KEYS[2], ARGV[6])
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
extend(KEYS[3], ARGV[6])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[5])
return 1
"""

# Unbind removes the business-key pointer only if it still names this wait: a newer wait
# with the same business key may have taken it over.
_UNBIND = """
redis.call('HDEL', KEYS[1], ARGV[1])
if KEYS[2] ~= '' and redis.call('HGET', KEYS[2], ARGV[2]) == ARGV[1] then
  redis.call('HDEL', KEYS[2], ARGV[2])
end
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# An hour leaves the hour index only when every one of its shards is empty, checked and
# removed in one script so that a concurrent bind into that hour cannot be orphaned.
_RETIRE_HOUR = """
for i = 2, #KEYS do
  if redis.call('ZCARD', KEYS[i]) > 0 then return 0 end
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# All or none: a replay must not consume one claim of a pair and fail on the other.
_CLAIM_ALL = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return 0 end
end
for i = 1, #KEYS do redis.call('SET', KEYS[i], '1', 'PX', ARGV[1]) end
return 1
"""

# The registry is last-generation-wins: a repair that read an old header while the
# session moved on must not put the old state back. Members score 0, so sets sort by
# session id, which starts with the creation time: newest-first pagination for free.
_RECORD = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local gen = tonumber(string.match(cur, '|(%d+)$') or '-1')
  if gen > tonumber(ARGV[2]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. '|' .. ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[1])
for i = 4, #ARGV do
  if ARGV[i] == ARGV[3] then
    redis.call('ZADD', KEYS[i - 1], 0, ARGV[1])
  else
    redis.call('ZREM', KEYS[i - 1], ARGV[1])
  end
end
return 1
"""

_CLAIM_IDEMPOTENCY = """
local cur = redis.call('HMGET', KEYS[1], 'sid', 'fp', 'st')
if cur[1] then return {0, cur[1], cur[2], cur[3]} end
redis.call('HSET', KEYS[1], 'sid', ARGV[1], 'fp', ARGV[2], 'st', 'in_progress')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, ARGV[1], ARGV[2], 'in_progress'}
"""

# A lease is free if absent or expired at the caller's ``now``. The fencing counter only
# ever increases, so a stale holder's token is always smaller than the current one.
_ACQUIRE = """
local exp = tonumber(redis.call('HGET', KEYS[1], 'exp') or '0')
local now = tonumber(ARGV[2])
if exp > now then return nil end
local token = redis.call('INCR', KEYS[2])
local new_exp = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'exp', new_exp)
redis.call('PEXPIREAT', KEYS[1], new_exp + tonumber(ARGV[5]))
redis.call('ZADD', KEYS[3], new_exp, ARGV[4])
return {token, new_exp}
"""

# Renewal needs only that the lease is still ours: a holder whose heartbeat came late but
# whom nobody replaced may go on (anyone who took over changed owner and token).
_RENEW = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
local now = tonumber(ARGV[3])
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return nil end
local new_exp = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'exp', new_exp)
redis.call('PEXPIREAT', KEYS[1], new_exp + tonumber(ARGV[6]))
redis.call('ZADD', KEYS[2], new_exp, ARGV[5])
return new_exp
"""

_RELEASE = """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'token')
if cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
return 1
"""

_FORGET = """
local exp = tonumber(redis.call('HGET', KEYS[1], 'exp') or '0')
if exp <= tonumber(ARGV[2]) then redis.call('ZREM', KEYS[2], ARGV[1]) return 1 end
return 0
"""


def _translate(
    fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Turn redis-py's connection errors into the domain's typed IndexUnavailable."""

    @wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        self = cast("RedisIndex", args[0])
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise IndexUnavailable(
                f"Redis index at {self.url} is not reachable ({type(exc).__name__})"
            ) from exc
        except RedisError as exc:
            raise IndexUnavailable(f"Redis index at {self.url} failed: {exc}") from exc

    return wrapper


class RedisIndex:
    def __init__(
        self,
        url: str,
        *,
        prefix: str = "tp:",
        buckets: int = 512,
        deadline_shards: int = 128,
        client: aioredis.Redis | None = None,
    ) -> None:
        self._url = url
        self.keys = RedisKeys(prefix, buckets=buckets, deadline_shards=deadline_shards)
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            url, decode_responses=True, socket_timeout=5, socket_connect_timeout=5
        )
        self._bind = self._redis.register_script(_BIND)
        self._unbind = self._redis.register_script(_UNBIND)
        self._retire_hour = self._redis.register_script(_RETIRE_HOUR)
        self._claim_idem = self._redis.register_script(_CLAIM_IDEMPOTENCY)
        self._claim_all = self._redis.register_script(_CLAIM_ALL)
        self._record = self._redis.register_script(_RECORD)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)
        self._forget = self._redis.register_script(_FORGET)

    @property
    def url(self) -> str:
        # Never show a password that may be in the URL.
        scheme, _, rest = self._url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}"

    @property
    def client(self) -> aioredis.Redis:
        return self._redis

    @_translate
    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    # -- waits --------------------------------------------------------------------------

    @staticmethod
    def _hour(deadline: datetime) -> int:
        return to_ms(deadline) // 3_600_000

    def _bk(self, tenant: str, business_key: str | None) -> tuple[str, str]:
        return self.keys.business_key(tenant, business_key) if business_key else ("", "")

    @_translate
    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta
    ) -> None:
        expires = to_ms(binding.deadline + grace)
        cid = binding.correlation_id
        bk_key, bk_field = self._bk(binding.tenant, business_key)
        hour = self._hour(binding.deadline)
        await self._bind(
            keys=[
                self.keys.correlation(cid),
                bk_key,
                self.keys.deadline_set(cid, hour),
                self.keys.deadline_hours,
            ],
            args=[
                cid,
                encode_binding(binding, expires_ms=expires),
                bk_field,
                to_ms(binding.deadline),
                hour,
                expires,
            ],
        )

    async def _stored(self, correlation_id: str) -> StoredBinding | None:
        raw = _opt(await self._redis.hget(self.keys.correlation(correlation_id), correlation_id))
        return decode_binding(correlation_id, raw) if raw else None

    @_translate
    async def resolve(
        self, *, tenant: str, correlation_id: str | None = None, business_key: str | None = None
    ) -> WaitBinding | None:
        cid = correlation_id
        if cid is None and business_key is not None:
            key, field = self.keys.business_key(tenant, business_key)
            cid = _opt(await self._redis.hget(key, field))
        if cid is None:
            return None
        stored = await self._stored(cid)
        if stored is None or stored.expires_ms <= wall_ms():
            return None
        return stored.binding if stored.binding.tenant == tenant else None

    @_translate
    async def unbind(self, *, tenant: str, correlation_id: str, business_key: str | None) -> None:
        stored = await self._stored(correlation_id)
        if stored is None or stored.binding.tenant != tenant:
            return
        await self._remove(stored.binding, business_key)

    async def _remove(self, binding: WaitBinding, business_key: str | None) -> None:
        bk_key, bk_field = self._bk(binding.tenant, business_key)
        cid = binding.correlation_id
        await self._unbind(
            keys=[
                self.keys.correlation(cid),
                bk_key,
                self.keys.deadline_set(cid, self._hour(binding.deadline)),
            ],
            args=[cid, bk_field],
        )

    @_translate
    async def due_deadlines(self, *, now: datetime, limit: int) -> list[WaitBinding]:
        now_ms = to_ms(now)
        now_hour = now_ms // 3_600_000
        raw_hours = await self._redis.zrangebyscore(self.keys.deadline_hours, "-inf", now_hour)
        out: list[WaitBinding] = []
        for hour in (int(h) for h in _strs(raw_hours)):
            shards = [self.keys.deadline_shard(hour, i) for i in range(self.keys.deadline_shards)]
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in shards:
                    pipe.zrangebyscore(key, "-inf", now_ms, start=0, num=limit)
                found = await pipe.execute()
            # The earliest deadlines of an hour may sit in any shard: read every shard up
            # to ``limit`` and sort the union.
            for key, cids in zip(shards, found, strict=True):
                for cid in _strs(cids):
                    stored = await self._stored(cid)
                    if stored is None:
                        # The binding is gone but its deadline entry is not: garbage.
                        await self._redis.zrem(key, cid)
                    elif stored.expires_ms <= wall_ms():
                        await self._remove(stored.binding, None)  # logical TTL passed
                    else:
                        out.append(stored.binding)
            if hour < now_hour and not any(found):
                await self._retire_hour(keys=[self.keys.deadline_hours, *shards], args=[hour])
            if len(out) >= limit:
                break
        out.sort(key=lambda b: b.deadline)
        return out[:limit]

    # -- timers -------------------------------------------------------------------------

    @_translate
    async def schedule(self, *, kind: TimerKind, member: str, at: datetime) -> None:
        await self._redis.zadd(self.keys.timers(kind), {member: to_ms(at)})

    @_translate
    async def unschedule(self, *, kind: TimerKind, member: str) -> None:
        await self._redis.zrem(self.keys.timers(kind), member)

    @_translate
    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        return _strs(
            await self._redis.zrangebyscore(
                self.keys.timers(kind), "-inf", to_ms(now), start=0, num=limit
            )
        )

    # -- dedupe and idempotency ---------------------------------------------------------

    @_translate
    async def claim_nonce(self, *, scope: str, nonce: str, ttl: timedelta) -> bool:
        ttl_ms = max(1, int(ttl.total_seconds() * 1000))
        claimed = await self._redis.set(self.keys.nonce(scope, nonce), "1", nx=True, px=ttl_ms)
        return bool(claimed)

    @_translate
    async def claim_nonces(self, claims: list[tuple[str, str]], *, ttl: timedelta) -> bool:
        keys = [self.keys.nonce(scope, nonce) for scope, nonce in claims]
        return bool(await self._claim_all(keys=keys, args=[_ms(ttl)]))

    @_translate
    async def admit(
        self,
        *,
        claims: list[tuple[str, str]],
        ttl: timedelta,
        tenant: str,
        correlation_id: str | None,
        business_key: str | None,
    ) -> Admission:
        keys = [self.keys.nonce(scope, nonce) for scope, nonce in claims]
        async with self._redis.pipeline(transaction=False) as pipe:
            await self._claim_all(keys=keys, args=[_ms(ttl)], client=pipe)
            if correlation_id is not None:
                pipe.hget(self.keys.correlation(correlation_id), correlation_id)
            elif business_key is not None:
                pipe.hget(*self.keys.business_key(tenant, business_key))
            answers = await pipe.execute()
        if not answers[0]:
            return Admission(False, None)
        found = _opt(answers[1]) if len(answers) > 1 else None
        if found is None:
            return Admission(True, None)
        if correlation_id is None:  # a business key gave us the correlation id: one hop more
            return Admission(True, await self.resolve(tenant=tenant, correlation_id=found))
        stored = decode_binding(correlation_id, found)
        live = stored is not None and stored.expires_ms > wall_ms()
        binding = stored.binding if live and stored and stored.binding.tenant == tenant else None
        return Admission(True, binding)

    @_translate
    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        await self._redis.delete(self.keys.nonce(scope, nonce))

    @_translate
    async def claim_idempotency(
        self, *, tenant: str, key: str, fingerprint: str, session_id: str, ttl: timedelta
    ) -> IdempotencyRecord:
        ttl_ms = max(1, int(ttl.total_seconds() * 1000))
        created, sid, fp, status = await self._claim_idem(
            keys=[self.keys.idempotency(tenant, key)], args=[session_id, fingerprint, ttl_ms]
        )
        return IdempotencyRecord(key, sid, fp, IdempotencyStatus(status), bool(created))

    @_translate
    async def finish_idempotency(self, *, tenant: str, key: str, ttl: timedelta) -> None:
        name = self.keys.idempotency(tenant, key)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(name, "st", IdempotencyStatus.DONE.value)
            pipe.pexpire(name, max(1, int(ttl.total_seconds() * 1000)))
            await pipe.execute()

    @_translate
    async def release_idempotency(self, *, tenant: str, key: str) -> None:
        await self._redis.delete(self.keys.idempotency(tenant, key))

    # -- leases -------------------------------------------------------------------------

    @_translate
    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None:
        got = await self._acquire(
            keys=[self.keys.lease(name), self.keys.fence(name), self.keys.lease_expiry],
            args=[owner, to_ms(now), _ms(ttl), name, LEASE_GC],
        )
        if got is None:
            return None
        token, expires = got
        return Lease(name, owner, int(token), from_ms(int(expires)))

    @_translate
    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        expires = await self._renew(
            keys=[self.keys.lease(lease.name), self.keys.lease_expiry],
            args=[lease.owner, lease.token, to_ms(now), _ms(ttl), lease.name, LEASE_GC],
        )
        if expires is None:
            return None
        return Lease(lease.name, lease.owner, lease.token, from_ms(int(expires)))

    @_translate
    async def release_lease(self, lease: Lease) -> bool:
        released = await self._release(
            keys=[self.keys.lease(lease.name), self.keys.lease_expiry],
            args=[lease.owner, lease.token, lease.name],
        )
        return bool(released)

    @_translate
    async def expired_leases(self, *, now: datetime, limit: int) -> list[str]:
        return _strs(
            await self._redis.zrangebyscore(
                self.keys.lease_expiry, "-inf", to_ms(now), start=0, num=limit
            )
        )

    @_translate
    async def forget_lease(self, *, name: str, now: datetime) -> None:
        keys = [self.keys.lease(name), self.keys.lease_expiry]
        await self._forget(keys=keys, args=[name, to_ms(now)])

    # -- session registry ---------------------------------------------------------------

    @_translate
    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> None:
        # KEYS: state hash, the all-sessions set, then one set per state in ARGV order.
        keys = [
            self.keys.session_state,
            self.keys.sessions(tenant, None),
            *(self.keys.sessions(tenant, s) for s in SessionState),
        ]
        await self._record(
            keys=keys,
            args=[session_id, generation, state.value, *(s.value for s in SessionState)],
        )

    @_translate
    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]:
        if not session_ids:
            return {}
        values = await self._redis.hmget(self.keys.session_state, session_ids)
        return {
            sid: SessionState(_str(v).partition("|")[0])
            for sid, v in zip(session_ids, values, strict=True)
            if v
        }

    @_translate
    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage:
        upper = f"({cursor}" if cursor else "+"
        ids = _strs(
            await self._redis.zrevrangebylex(
                self.keys.sessions(tenant, state), upper, "-", start=0, num=limit + 1
            )
        )
        more = len(ids) > limit
        ids = ids[:limit]
        return SessionPage(ids, ids[-1] if more else None)

    # -- counters and integrity ---------------------------------------------------------

    @_translate
    async def incr(self, name: str, by: int = 1) -> int:
        return int(await self._redis.hincrby(self.keys.counters, name, by))

    @_translate
    async def counters(self) -> dict[str, int]:
        raw = await self._redis.hgetall(self.keys.counters)
        return {_str(k): int(v) for k, v in raw.items()}

    @_translate
    async def mark_intact(self) -> None:
        await self._redis.set(self.keys.intact, "1")

    @_translate
    async def is_intact(self) -> bool:
        return bool(await self._redis.exists(self.keys.intact))


def wall_ms() -> int:
    """Wall-clock ms for the logical TTL of bound waits (as a Redis TTL would use)."""
    return int(time.time() * 1000)


def _str(value: bytes | str) -> str:
    # The client decodes responses; this only narrows redis-py's bytes | str annotations.
    return value.decode() if isinstance(value, bytes) else value


def _opt(value: bytes | str | None) -> str | None:
    return None if value is None else _str(value)


def _strs(values: Any) -> list[str]:
    return [_str(v) for v in values]


def _ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))
