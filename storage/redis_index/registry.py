"""The session registry in Redis: one state hash, sorted sets per tenant and state."""

from __future__ import annotations

import asyncio
import time

from storage.redis_index.connection import RedisConnection, opt_text, text, texts, translate
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState
from torpor.ports import SessionEntry, SessionPage

_STATE_VALUES = tuple(s.value for s in SessionState)  # a commit's script's ARGV, in order

# The entry of ARGV[1] as it stands: its state and generation (false, false: none; Lua
# reads a missing hash field as false, never nil, so "none" is tested with ``not``). An entry
# reads "state|tenant|generation" ("state|generation" as an older torpor wrote it): state
# and generation are read off its two ends, so both forms read the same, here, in
# ``session_states`` and in an older torpor's copy of these scripts. ``at``: the
# generation to write (ARGV[2], unless a script keeps the entry's).
_CURRENT = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local state = cur and string.match(cur, '^[^|]*')
local gen = cur and tonumber(string.match(cur, '|(%d+)$') or '-1')
local at = ARGV[2]
"""
# The state of ARGV[1] written (ARGV[3] at generation ``at``, under tenant ARGV[4]), in the
# state hash and the sets (ARGV[5] is the script's own condition, ``_record_state``).
# Members score 0, so sets sort by session id, which starts with the creation time:
# newest-first pagination for free. The hash carries the tenant: the
# quarantine of a snapshot whose header did not decode finds the session's tenant there
# (``RedisSessionRegistry.session_entry``), so it stays listed under it. Under a tenant,
# it leaves tenant ""'s sets (the last two keys): only the quarantine of a snapshot whose
# header did not decode, its tenant unknown to the index too, puts a session there. So
# the two ZREMs are made only where the entry as it stands names tenant "", or no tenant
# at all: an older torpor's "state|generation" (whose own poison quarantine may have left
# a ghost there), or no entry (the first record of a session, or a state hash lost while
# the sets stayed). An entry that names a real tenant was written by this code, which
# never leaves a session under tenant "" as well: every commit's record skips them.
_WRITE = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. '|' .. ARGV[4] .. '|' .. at)
local was = cur and string.match(cur, '^[^|]*|(.*)|%d+$')
if KEYS[2] ~= KEYS[#KEYS - 1] and (not was or was == '') then
  redis.call('ZREM', KEYS[#KEYS - 1], ARGV[1])
  redis.call('ZREM', KEYS[#KEYS], ARGV[1])
end
redis.call('ZADD', KEYS[2], 0, ARGV[1])
for i = 6, #ARGV do
  if ARGV[i] == ARGV[3] then
    redis.call('ZADD', KEYS[i - 3], 0, ARGV[1])
  else
    redis.call('ZREM', KEYS[i - 3], ARGV[1])
  end
end
"""
_WRITTEN = _WRITE + "return 1\n"
# Under a tenant the caller did not know but looked up (``_under_tenant_held``), only
# over the entry it looked at (ARGV[5], "=" and the value, "=" alone for none; "" when
# the caller named the tenant): a record since may name another, and the look is made
# again (-1).
_AS_LOOKED = """
if ARGV[5] ~= '' and ARGV[5] ~= '=' .. (cur or '') then return -1 end
"""
# The registry is last-generation-wins: a repair that read an old header while the
# session moved on must not put the old state back.
_RECORD = (
    _CURRENT
    + _AS_LOOKED
    + """
if gen and gen > tonumber(ARGV[2]) then return 0 end
"""
    + _WRITTEN
)
# Only over a QUARANTINED, checked and written in one step: a commit recorded after the
# caller's look is never replaced by the state it found. And only under the tenant the
# entry names, if it names one (``SessionRegistry.lift_quarantine``): a session's tenant
# never changes, "" (a poison quarantine's, unknown) or an older torpor's entry aside.
_OVER_QUARANTINE = f"""
if state ~= '{SessionState.QUARANTINED.value}' then return 0 end
local held = string.match(cur, '^[^|]*|(.*)|%d+$')
if held and held ~= '' and held ~= ARGV[4] then return 0 end
"""
# ... and no newer (an activation's lift).
_LIFT = (
    _CURRENT
    + _OVER_QUARANTINE
    + """
if gen > tonumber(ARGV[2]) then return 0 end
"""
    + _WRITTEN
)
# ... at exactly generation ARGV[5], the one the operator's retry read, whatever the
# generation written (``SessionRegistry.lift_quarantine``): a backup restored from before
# the quarantine is older, but a QUARANTINED recorded since the read (a newer snapshot
# found undecodable) is not the one the operator took back, and stays.
_LIFT_AT = (
    _CURRENT
    + _OVER_QUARANTINE
    + """
if gen ~= tonumber(ARGV[5]) then return 0 end
"""
    + _WRITTEN
)
# A poison quarantine (``SessionRegistry.record_poison``): over any state, never back in
# generation; it returns the generation it wrote.
_POISON = (
    _CURRENT
    + _AS_LOOKED
    + """
if gen and gen > tonumber(ARGV[2]) then at = string.match(cur, '|(%d+)$') end
"""
    + _WRITE
    + "return tonumber(at)\n"
)

# A record under a tenant looked up (``_under_tenant_held``) is written only over the entry
# looked at; a session recorded this often meanwhile is being recorded by callers that
# know its tenant (for a poison quarantine: it is not one whose snapshot is lost, and is
# left to its next activation).
_LOOKS = 5
# A read's tenant lookup (``session_entry``) for a session a SCAN found no tenant lists
# answers "" for this many seconds after it, without a SCAN of its own (``_listed_under``);
# at most this many such sessions are remembered, the oldest forgotten first.
_RESCAN_S = 60.0
_UNLISTED_KEPT = 1024


def _fields(value: str) -> tuple[str, str | None, str]:
    """An entry of the state hash as its state, tenant and generation: "state|tenant|
    generation", or an older torpor's "state|generation", whose tenant is None (unknown,
    not ""). A tenant may hold "|": state and generation are read off the two ends."""
    state, _, rest = value.partition("|")
    tenant, bar, generation = rest.rpartition("|")
    return state, tenant if bar else None, generation


class RedisSessionRegistry(RedisConnection):
    # The tenants whose listings the SCAN that started last found (``_scan_from``), and
    # when it started; replaced whole, never shrunk in place, so a look running meanwhile
    # reads one set or the other.
    _tenants_found: frozenset[str] = frozenset()
    _scanned_at = float("-inf")
    # Sessions a SCAN found no tenant lists, with when (time.monotonic()), oldest first.
    _unlisted: dict[str, float] | None = None
    _scanning: asyncio.Future[frozenset[str]] | None = None  # a read's SCAN, shared

    @translate
    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> bool:
        # ``_RECORD`` answers 1 (written) or 0 (a newer generation kept); the -1 of an
        # entry changed since its look never leaves ``_under_tenant_held``.
        if tenant:
            written = await self._record_state(_RECORD, tenant, session_id, state, generation)
        else:  # the entry's tenant is never lost (``SessionRegistry.record_session``)
            written = await self._under_tenant_held(_RECORD, session_id, state, generation)
        return written == 1

    @translate
    async def lift_quarantine(
        self,
        *,
        tenant: str,
        session_id: str,
        state: SessionState,
        generation: int,
        quarantined_at: int | None = None,
    ) -> bool:
        if quarantined_at is None:
            # The activation's lift runs before the lease's release sent after it
            # (``release.let_go``), even on a server that forgot its scripts.
            lifted = await self._record_state(
                _LIFT, tenant, session_id, state, generation, ordered=True
            )
        else:
            lifted = await self._record_state(
                _LIFT_AT, tenant, session_id, state, generation, quarantined_at
            )
        return bool(lifted)

    @translate
    async def record_poison(self, *, tenant: str, session_id: str, generation: int) -> int:
        aside = SessionState.QUARANTINED
        if tenant:
            return await self._record_state(_POISON, tenant, session_id, aside, generation)
        # Tenant "": the caller's header did not read and the entry it read named none.
        # Recorded under "", an entry an older torpor wrote ("state|generation", no
        # tenant) left the session listed under its real tenant in its old state, and
        # its tenant's GET and retry found a quarantine under "": 404.
        return await self._under_tenant_held(_POISON, session_id, aside, generation)

    async def _under_tenant_held(
        self, script: str, session_id: str, state: SessionState, generation: int
    ) -> int:
        """``script`` (``_RECORD``, ``_POISON``) for a caller that does not know the tenant:
        under the one the entry names, else the one whose listing holds the session
        (``_tenant_of``), "" if none does. Written only over the entry looked at (a
        compare-and-set, ``_AS_LOOKED``): a record in between sends it round again."""
        for _ in range(_LOOKS):
            value = opt_text(await self._redis.hget(self.keys.session_state, session_id))
            found = await self._tenant_of(session_id, value)
            written = await self._record_state(
                script, found, session_id, state, generation, "=" + (value or "")
            )
            if written >= 0:
                return written
        raise IndexUnavailable(f"the entry of session {session_id} kept changing under a look")

    async def _tenant_of(self, session_id: str, value: str | None, *, read: bool = False) -> str:
        """The tenant entry ``value`` names; for an older torpor's, which names none, the
        one whose listing holds the session (``_listed_under``); "" if none does."""
        if value is None:
            return ""
        named = _fields(value)[1]
        return named if named is not None else await self._listed_under(session_id, read=read)

    async def _listed_under(self, session_id: str, *, read: bool = False) -> str:
        """The tenant (other than "") whose all-sessions set holds ``session_id``, "" if
        none does: the set names the tenant, and nothing else in the index does for an
        older torpor's entry. First among the tenants a SCAN found before, one ZSCORE
        each in one round trip (a session's tenant never changes: a set that holds it
        is the answer); only when none does, a SCAN of the keyspace for every tenant's
        set, which they are refreshed from. The SCAN is linear in the keyspace (a fence
        counter per session ever leased), so a process makes it once, and again only
        for a session no tenant it knows of lists (a tenant new since, or none).

        ``read``: for a read (``session_entry``) of a session a SCAN found no tenant
        lists, that again at most once in ``_RESCAN_S``: every GET of such an entry (an
        older torpor's poison quarantine, under no tenant) made a SCAN of its own, back
        to back. A write (a record under the tenant held) always looks: a tenant whose
        first session an older torpor still running listed since would otherwise lose
        it to tenant "" for good."""
        began, known = time.monotonic(), self._tenants_found
        held = await self._holder(session_id, known)
        if held:
            return held
        unlisted = self._unlisted if self._unlisted is not None else {}
        self._unlisted = unlisted
        seen = unlisted.get(session_id)
        if read and seen is not None and time.monotonic() - seen < _RESCAN_S:
            return ""  # a SCAN found none lately; a tenant listing it since, at the next
        started = time.monotonic()
        listed = await (self._shared_scan(began) if read else self._scan_from(started))
        held = await self._holder(session_id, listed - known)
        unlisted.pop(session_id, None)
        if not held:
            unlisted[session_id] = started  # newest last: the oldest goes first
            while len(unlisted) > _UNLISTED_KEPT:
                del unlisted[next(iter(unlisted))]
        return held

    async def _shared_scan(self, began: float) -> frozenset[str]:
        """``_every_tenant`` for a read that began its look at ``began``: what a SCAN
        that started since found (as fresh as one of its own), else the SCAN running for
        another read, else one of its own that reads meanwhile share. Each read of an
        unlisted session started a SCAN of its own, all at once under concurrent reads.
        Shielded: a reader cancelled does not cancel the others' SCAN."""
        if self._scanned_at >= began:
            return self._tenants_found
        scan = self._scanning
        if scan is None or scan.done():
            scan = self._scanning = asyncio.ensure_future(self._scan_from(time.monotonic()))
            # Its failure is each waiting reader's; with none left, retrieved here.
            scan.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(scan)

    async def _scan_from(self, started: float) -> frozenset[str]:
        """``_every_tenant``, kept as the tenants found unless a SCAN that started later
        has been kept already (reads' and writes' SCANs overlap)."""
        listed = await self._every_tenant()
        if started >= self._scanned_at:
            self._tenants_found, self._scanned_at = listed, started
        return listed

    async def _every_tenant(self) -> frozenset[str]:
        """Every tenant (other than "") an all-sessions set names: one SCAN of the keyspace."""
        return frozenset(
            tenant
            for tenant in map(
                self.keys.tenant_of_sessions,
                texts(
                    [
                        k
                        async for k in self._redis.scan_iter(
                            match=self.keys.every_tenants_sessions, count=1000, _type="zset"
                        )
                    ]
                ),
            )
            if tenant
        )

    async def _holder(self, session_id: str, tenants: frozenset[str]) -> str:
        """The first of ``tenants`` whose all-sessions set holds ``session_id``, "" if none."""
        if not tenants:
            return ""
        ordered = sorted(tenants)
        pipe = self._redis.pipeline(transaction=False)
        for tenant in ordered:
            pipe.zscore(self.keys.sessions(tenant, None), session_id)
        scores = await pipe.execute()
        holders = [t for t, score in zip(ordered, scores, strict=True) if score is not None]
        return holders[0] if holders else ""  # a session's tenant never changes: one

    async def _record_state(
        self,
        script: str,
        tenant: str,
        session_id: str,
        state: SessionState,
        generation: int,
        condition: str | int = "",
        *,
        ordered: bool = False,
    ) -> int:
        # KEYS: state hash, the all-sessions set, one set per state in ARGV order, then
        # tenant ""'s all-sessions and QUARANTINED sets (``_WRITE``). ARGV: the session,
        # generation, state, tenant, the script's own ``condition``, the states.
        keys = [
            self.keys.session_state,
            self.keys.sessions(tenant, None),
            *self.keys.every_states_sessions(tenant),
            self.keys.sessions("", None),
            self.keys.sessions("", SessionState.QUARANTINED),
        ]
        call = self.ordered_script(script) if ordered else self.script(script)
        written: int = await call(
            keys=keys,
            args=[
                session_id,
                generation,
                state.value,
                tenant,
                condition,
                *_STATE_VALUES,
            ],
        )
        return written

    @translate
    async def forget_session(self, *, tenant: str, session_id: str) -> None:
        pipe = self._redis.pipeline(transaction=True)
        pipe.hdel(self.keys.session_state, session_id)
        pipe.zrem(self.keys.sessions(tenant, None), session_id)
        for state in SessionState:
            pipe.zrem(self.keys.sessions(tenant, state), session_id)
        # A session purged while quarantined under tenant "" (its header never read, never
        # restored) is listed there, not under its tenant: nothing else removes it (_WRITE).
        pipe.zrem(self.keys.sessions("", None), session_id)
        pipe.zrem(self.keys.sessions("", SessionState.QUARANTINED), session_id)
        await pipe.execute()

    @translate
    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]:
        if not session_ids:
            return {}
        values = await self._redis.hmget(self.keys.session_state, session_ids)
        return {
            sid: SessionState(text(v).partition("|")[0])
            for sid, v in zip(session_ids, values, strict=True)
            if v
        }

    @translate
    async def session_entry(self, session_id: str) -> SessionEntry | None:
        value = opt_text(await self._redis.hget(self.keys.session_state, session_id))
        if not value:
            return None
        state, _, generation = _fields(value)
        # An older torpor's entry names no tenant: the one whose listing holds the session,
        # as ``record_poison`` finds it. Read as "", the stand-in of a session whose header
        # does not read (``quarantine.stand_in``) named tenant "", and its tenant's GET
        # answered 404 until a record rewrote the entry. The entry is not rewritten here:
        # named, a record would skip tenant ""'s sets (``_WRITE``) and leave a ghost an
        # older torpor's poison quarantine put there; any record rewrites it whole.
        tenant = await self._tenant_of(session_id, value, read=True)
        return SessionEntry(tenant, SessionState(state), int(generation))

    @translate
    async def quarantine_generation(self, session_id: str) -> int | None:
        # In the lean connection's next batch, as the lift and the release beside it are:
        # read between them, in their order (``SessionRegistry.quarantine_generation``).
        value = await self.batched("HGET", self.keys.session_state, session_id)
        if not value:
            return None
        state, _, generation = _fields(text(value))
        if state != SessionState.QUARANTINED.value or not generation.isdigit():
            return None
        return int(generation)

    @translate
    async def session_generation(self, session_id: str) -> int | None:
        value = await self._redis.hget(self.keys.session_state, session_id)
        generation = text(value).rpartition("|")[2] if value else ""
        return int(generation) if generation.isdigit() else None

    @translate
    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage:
        upper = f"({cursor}" if cursor else "+"
        ids = texts(
            await self._redis.zrevrangebylex(
                self.keys.sessions(tenant, state), upper, "-", start=0, num=limit + 1
            )
        )
        more = len(ids) > limit
        ids = ids[:limit]
        return SessionPage(ids, ids[-1] if more else None)
