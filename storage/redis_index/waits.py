"""Open waits in Redis: correlation and business-key buckets, deadline shards by hour.

A wait is three entries: a field in a correlation hash bucket, a business-key pointer in
a hash bucket, and a member of one shard of its deadline hour's sorted sets (the hour is
listed in an hour index). Buckets keep each structure small enough for Redis' compact
listpack encoding. Hash fields cannot carry a TTL before Redis 7.4, so each entry holds
its own expiry (deadline + grace), checked against the caller's ``now``, and each bucket
key lives at least as long as its latest entry.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from storage.bindings import VERSION as BINDING_VERSION
from storage.bindings import StoredBinding, decode_binding, encode_binding
from storage.redis_index.connection import RedisConnection, opt_text, texts, translate
from torpor.clock import to_ms
from torpor.ports import WaitBinding

# A pointer's holder, looked at by a second try (``_HOLDER_GONE``): KEYS[5] the bucket of
# the correlation id ARGV[10] the first try found in the pointer. A pointer outlives its
# wait when the wait was unbound without its business key (the sweeper unbinds left-over
# and set-aside waits so: their key is not in the binding), and its own expiry then held
# the key from every other session until the grace ran out; the memory and SQLite
# indexes, which look at the holder's binding, gave it free at once. Only a binding that
# is gone or expired frees the key (one this version cannot read still holds it).
_HOLDER_GONE = """
local function holder_gone(cid, now)
  if #KEYS < 5 or cid ~= ARGV[10] then return false end
  local raw = redis.call('HGET', KEYS[5], cid)
  if not raw then return true end
  local deadline, rest = string.match(raw, '|([0-9a-z]+)|([0-9a-z]+)$')
  if not deadline then return false end
  return tonumber(deadline, 36) + tonumber(rest, 36) * 1000 <= now
end
"""

# ARGV[6] is the time to live of the new entry: a bucket's TTL only ever grows.
# The business-key pointer is "correlation id|session id|expiry ms", so the script can
# tell, without another key, whether another session's unexpired wait holds the key: then
# it keeps it (checked and written in one script, so two sessions binding at once cannot
# both take it) and the script returns 0. A pointer written before it named its session
# (a bare correlation id) is taken over, as it always was.
_BIND = (
    _HOLDER_GONE
    + """
local function extend(key, ttl)
  if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
end
local taken = false
if KEYS[2] ~= '' then
  local held = redis.call('HGET', KEYS[2], ARGV[3])
  if held then
    local cid, sid, exp = string.match(held, '^([^|]*)|([^|]*)|(%d+)$')
    local now = tonumber(ARGV[7])
    if cid and cid ~= ARGV[1] and sid ~= ARGV[8] and tonumber(exp) > now then
      taken = not holder_gone(cid, now)
    end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
extend(KEYS[1], ARGV[6])
if KEYS[2] ~= '' and not taken then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[1] .. '|' .. ARGV[8] .. '|' .. ARGV[9])
  extend(KEYS[2], ARGV[6])
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
extend(KEYS[3], ARGV[6])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[5])
if taken then return 0 end
return 1
"""
)

BIND_SCRIPT = _BIND  # for a bulk writer that pipelines ``RedisWaits.bind_call``

# Mend, with _BIND's keys and arguments: only a binding stored exactly as this one (its
# expiry aside: the grace may have been configured anew since, or repair bound it for
# longer), and unexpired at ARGV[7], gets back the entries a partial loss took (an evicted
# or deleted shard, hour index or pointer), each to live as long as the binding itself
# (its own expiry: the deadline, then the grace in seconds). The pointer is taken as
# _BIND takes it: not from another session's unexpired wait. -1: not bound so, nothing
# changed; else how many entries were put back.
_MEND = (
    _HOLDER_GONE
    + """
local function extend(key, ttl)
  if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
end
local held = redis.call('HGET', KEYS[1], ARGV[1])
local function bare(raw) return string.match(raw, '^(.*)|[^|]*$') end
if not held or bare(held) ~= bare(ARGV[2]) then return -1 end
local deadline, rest = string.match(held, '|([0-9a-z]+)|([0-9a-z]+)$')
local expires = tonumber(deadline, 36) + tonumber(rest, 36) * 1000
local now = tonumber(ARGV[7])
if expires <= now then return -1 end
local ttl = expires - now
local mended = 0
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
  extend(KEYS[3], ttl)
  mended = mended + 1
end
mended = mended + redis.call('ZADD', KEYS[4], ARGV[5], ARGV[5])
if KEYS[2] ~= '' then
  local owner = redis.call('HGET', KEYS[2], ARGV[3])
  local taken = false
  if owner then
    local cid, sid, exp = string.match(owner, '^([^|]*)|([^|]*)|(%d+)$')
    if owner == ARGV[1] or cid == ARGV[1] then
      taken = true
    elseif cid and sid ~= ARGV[8] and tonumber(exp) > now then
      taken = not holder_gone(cid, now)
    end
  end
  if not taken then
    redis.call('HSET', KEYS[2], ARGV[3], ARGV[1] .. '|' .. ARGV[8] .. '|' .. expires)
    extend(KEYS[2], ttl)
    mended = mended + 1
  end
end
return mended
"""
)

# Unbind removes the business-key pointer only if it still names this wait: a newer wait
# with the same business key may have taken it over.
_UNBIND = """
redis.call('HDEL', KEYS[1], ARGV[1])
if KEYS[2] ~= '' then
  local held = redis.call('HGET', KEYS[2], ARGV[2])
  if held and (held == ARGV[1] or string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '|') then
    redis.call('HDEL', KEYS[2], ARGV[2])
  end
end
redis.call('ZREM', KEYS[3], ARGV[1])
return 1
"""

# Unbind for a caller that knows the wait's deadline, so the deadline's key, in one
# round trip: the binding is read here, not by the caller first. KEYS as for _UNBIND, the
# third for the hour the caller named; ARGV: cid, business-key field, tenant, that hour.
# 0: no binding of that tenant (nothing to do, as when the caller read it); -1: the
# binding is unreadable here or its deadline falls in another hour, nothing is changed
# and the caller reads it and unbinds in two steps, as before.
_UNBIND_KNOWN = (
    """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local version, tenant, deadline = string.match(
  raw, '^([^|]*)|([^|]*)|[^|]*|[^|]*|[^|]*|([0-9a-z]+)|[0-9a-z]+$')
if version ~= '"""
    + BINDING_VERSION
    + """' then return -1 end
if tenant ~= ARGV[3] then return 0 end
local ms = tonumber(deadline, 36)
if not ms or math.floor(ms / 3600000) ~= tonumber(ARGV[4]) then return -1 end
"""
    + _UNBIND
)

# An hour leaves the hour index only when every one of its shards is empty, checked and
# removed in one script so that a concurrent bind into that hour cannot be orphaned.
_RETIRE_HOUR = """
for i = 2, #KEYS do
  if redis.call('ZCARD', KEYS[i]) > 0 then return 0 end
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


# The fewest bindings the deadline loop reads in one round trip (``due_deadlines``).
MIN_BINDING_READS = 16
# The fewest entries the deadline loop reads of each shard at first (``_earliest_due``).
MIN_SHARD_READS = 4


def _hour(deadline: datetime) -> int:
    return to_ms(deadline) // 3_600_000


def pointed(raw: str | None) -> str | None:
    """The correlation id a business-key pointer names (with or without its owner)."""
    return raw.split("|", 1)[0] if raw else None


def live(correlation_id: str, raw: str | None, *, tenant: str, now: datetime) -> WaitBinding | None:
    """The binding an encoded entry holds if it belongs to ``tenant`` and is unexpired."""
    stored = decode_binding(correlation_id, raw) if raw else None
    if stored is None or stored.expires_ms <= to_ms(now):
        return None
    return stored.binding if stored.binding.tenant == tenant else None


class RedisWaits(RedisConnection):
    def _bk(self, tenant: str, business_key: str | None) -> tuple[str, str]:
        return self.keys.business_key(tenant, business_key) if business_key else ("", "")

    @translate
    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> bool:
        keys, args = self.bind_call(binding, business_key=business_key, grace=grace, now=now)
        bound = int(await self.script(_BIND)(keys=keys, args=args))
        if not bound and await self._holder_of(keys, args):
            # Refused: once more, looking at the holder's binding (``_HOLDER_GONE``).
            bound = int(await self.script(_BIND)(keys=keys, args=args))
        return bool(bound)

    @translate
    async def mend_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> int | None:
        keys, args = self.bind_call(binding, business_key=business_key, grace=grace, now=now)
        mended = int(await self.script(_MEND)(keys=keys, args=args))
        if mended == 0 and business_key and await self._holder_of(keys, args):
            # Nothing put back, perhaps for a pointer whose wait is gone: once more,
            # looking at the holder's binding (``_HOLDER_GONE``).
            mended = int(await self.script(_MEND)(keys=keys, args=args))
        return None if mended < 0 else mended

    async def _holder_of(self, keys: list[str], args: list[str | int]) -> bool:
        """Add the bucket and correlation id of the wait another session's pointer names
        to a bind's ``keys`` and ``args``, for a second try; False if there is none."""
        if not keys[1]:
            return False
        holder = pointed(opt_text(await self.batched("HGET", keys[1], args[2])))
        if holder is None or holder == args[0]:
            return False
        keys.append(self.keys.correlation(holder))
        args.append(holder)
        return True

    def bind_call(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> tuple[list[str], list[str | int]]:
        """The bind script's (``BIND_SCRIPT``) keys and arguments for ``binding``: what
        ``bind_wait`` runs, and what a bulk writer (``bench/bench_scale.py``) pipelines,
        so the two cannot drift apart."""
        expires = to_ms(binding.deadline + grace)
        cid = binding.correlation_id
        bk_key, bk_field = self._bk(binding.tenant, business_key)
        hour = _hour(binding.deadline)
        keys = [
            self.keys.correlation(cid),
            bk_key,
            self.keys.deadline_set(cid, hour),
            self.keys.deadline_hours,
        ]
        args: list[str | int] = [
            cid,
            encode_binding(binding, expires_ms=expires),
            bk_field,
            to_ms(binding.deadline),
            hour,
            max(1, expires - to_ms(now)),
            to_ms(now),
            binding.session_id,
            expires,
        ]
        return keys, args

    async def _stored(self, correlation_id: str) -> StoredBinding | None:
        # On the lean pipelined path, as the lookups of a webhook and an activation are:
        # redis-py's own call costs 0.1-0.2 ms more CPU (``pipelining``), and a session's
        # resume reads its binding here once to unbind it.
        raw = await self.batched("HGET", self.keys.correlation(correlation_id), correlation_id)
        found = opt_text(raw)
        return decode_binding(correlation_id, found) if found else None

    @translate
    async def resolve(
        self,
        *,
        tenant: str,
        now: datetime,
        correlation_id: str | None = None,
        business_key: str | None = None,
    ) -> WaitBinding | None:
        cid = correlation_id
        if cid is None and business_key is not None:
            key, field = self.keys.business_key(tenant, business_key)
            cid = pointed(opt_text(await self.batched("HGET", key, field)))
        if cid is None:
            return None
        raw = opt_text(await self.batched("HGET", self.keys.correlation(cid), cid))
        return live(cid, raw, tenant=tenant, now=now)

    @translate
    async def unbind(
        self,
        *,
        tenant: str,
        correlation_id: str,
        business_key: str | None,
        deadline: datetime | None = None,
    ) -> None:
        if deadline is not None:
            # A resume unbinds the wait it answered: one round trip, not a read and then
            # a script (one round trip fewer per resume).
            bk_key, bk_field = self._bk(tenant, business_key)
            hour = _hour(deadline)
            removed = await self.batched_script(
                _UNBIND_KNOWN,
                keys=[
                    self.keys.correlation(correlation_id),
                    bk_key,
                    self.keys.deadline_set(correlation_id, hour),
                ],
                args=[correlation_id, bk_field, tenant, hour],
            )
            if int(removed) >= 0:
                return
        stored = await self._stored(correlation_id)
        if stored is None or stored.binding.tenant != tenant:
            return
        await self._remove(stored.binding, business_key)

    async def _remove(self, binding: WaitBinding, business_key: str | None) -> None:
        bk_key, bk_field = self._bk(binding.tenant, business_key)
        cid = binding.correlation_id
        await self.script(_UNBIND)(
            keys=[
                self.keys.correlation(cid),
                bk_key,
                self.keys.deadline_set(cid, _hour(binding.deadline)),
            ],
            args=[cid, bk_field],
        )

    @translate
    async def due_deadlines(self, *, now: datetime, limit: int) -> list[WaitBinding]:
        now_ms = to_ms(now)
        now_hour = now_ms // 3_600_000
        raw_hours = await self._redis.zrangebyscore(self.keys.deadline_hours, "-inf", now_hour)
        out: list[WaitBinding] = []
        for hour in (int(h) for h in texts(raw_hours)):
            shards = [self.keys.deadline_shard(hour, i) for i in range(self.keys.deadline_shards)]
            seen: set[str] = set()  # entries of this hour judged already (live, or not ours)
            any_due = False
            while len(out) < limit:
                # Only the bindings of the earliest entries are read, as many as are still
                # wanted (then more, only where some were not live): reading every
                # entry's binding cost up to 128 times ``limit`` HGETs a pass, four passes
                # a second in a backlog, to return ``limit``. At least a few at a time:
                # many entries that are not live (garbage left by a crash) behind a nearly
                # full ``out`` were one round trip each.
                want = len(seen) + max(limit - len(out), MIN_BINDING_READS)
                earliest = await self._earliest_due(shards, now_ms=now_ms, want=want)
                any_due = any_due or bool(earliest)
                fresh = [e for e in earliest if e[1] not in seen]
                if not fresh:
                    break
                seen.update(cid for _, cid, _ in fresh)
                await self._take_due(fresh, hour=hour, now_ms=now_ms, out=out)
                if len(earliest) < want:
                    break  # every due entry of the hour was read
            if hour < now_hour and not any_due:
                await self.script(_RETIRE_HOUR)(
                    keys=[self.keys.deadline_hours, *shards], args=[hour]
                )
            if len(out) >= limit:
                break
        out.sort(key=lambda b: b.deadline)
        return out[:limit]

    async def _earliest_due(
        self, shards: list[str], *, now_ms: int, want: int
    ) -> list[tuple[float, str, str]]:
        """The ``want`` earliest due entries (score, correlation id, shard) of one hour's
        ``shards``, earliest first; all of them if fewer are due.

        The earliest may sit in any shard, so each is read a page at a time, a page a
        shard being about its share of ``want`` twice over: an entry no later than the
        last one read of every shard that filled its page is known to come before every
        entry not read yet. Until ``want`` of those are known, the shards that filled
        their page are read on, each page twice the last (a hash spreads an hour's waits
        evenly, so the first pages are nearly always enough). Each shard was read up to
        ``limit`` entries and the union sorted: 128 times ``limit`` entries a pass in a
        backlog (an hour of 1,000 deadlines a second after an outage), 200,000 of them
        and 2.2 s a pass at ``limit`` 2,000, four passes a second."""
        page = max(MIN_SHARD_READS, 2 * -(-want // len(shards)))
        read: dict[str, list[tuple[float, str]]] = {key: [] for key in shards}
        more = list(shards)  # the shards that may hold due entries not read yet
        while True:
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in more:
                    offset = len(read[key])
                    pipe.zrangebyscore(key, "-inf", now_ms, start=offset, num=page, withscores=True)
                found = await pipe.execute()
            for key, entries in zip(more, found, strict=True):
                read[key] += [(score, cid) for cid, score in entries]
            more = [key for key, entries in zip(more, found, strict=True) if len(entries) == page]
            frontier = min((read[key][-1][0] for key in more), default=math.inf)
            known = sorted(
                (score, cid, key)
                for key, entries in read.items()
                for score, cid in entries
                if score <= frontier
            )
            if len(known) >= want or not more:
                return known[:want]
            page *= 2

    async def _take_due(
        self, due: list[tuple[float, str, str]], *, hour: int, now_ms: int, out: list[WaitBinding]
    ) -> None:
        """Read the bindings of due deadline entries (score, correlation id, shard) of
        ``hour``: live ones go to ``out``, the entries of gone or expired ones are dropped."""
        # One round trip for every entry's binding, not one each: at a thousand deadlines
        # a second the lookups are most of a sweep's time.
        async with self._redis.pipeline(transaction=False) as pipe:
            for _, cid, _ in due:
                pipe.hget(self.keys.correlation(cid), cid)
            raws = await pipe.execute()
        for (_, cid, key), raw in zip(due, raws, strict=True):
            entry = opt_text(raw)
            stored = decode_binding(cid, entry) if entry else None
            if entry and stored is None:
                # Bound, but not in a form this version reads (a newer torpor's, mid-
                # upgrade): its deadline is not ours to drop, as an unbind leaves the
                # binding alone. Removed here, the newer torpor never saw it fall due.
                continue
            if stored is None or _hour(stored.binding.deadline) != hour:
                # The binding is gone but its deadline entry is not: garbage. Or it was
                # bound again with a deadline in another hour (a bind adds the new hour's
                # entry and cannot find the old one): this entry is stale, and was a
                # not-yet-due wait timed out at every sweep until its deadline.
                await self._redis.zrem(key, cid)
            elif stored.expires_ms <= now_ms:
                await self._remove(stored.binding, None)  # logical TTL passed
            else:
                out.append(stored.binding)
