"""``sqlite:///path``: the embedded index for one host.

WAL mode lets readers run beside one writer; every change is one ``BEGIN IMMEDIATE``
transaction, so it takes the database's write lock up front and processes on the same
host serialise on it (``busy_timeout`` makes them wait instead of failing). A conditional
change decides by the row count of its ``INSERT … ON CONFLICT`` or ``UPDATE … WHERE``,
never by a read followed by a separate write.

sqlite3 blocks, so each index owns one connection used from one worker thread.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from storage.bindings import decode_binding, encode_binding
from torpor.clock import from_ms, to_ms
from torpor.errors import ConfigError, IndexUnavailable
from torpor.ids import digest
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

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bindings (
    correlation_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, encoded TEXT NOT NULL,
    deadline_ms INTEGER NOT NULL, expires_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS bindings_deadline ON bindings(deadline_ms);
CREATE TABLE IF NOT EXISTS business_keys (
    tenant TEXT NOT NULL, bk TEXT NOT NULL, correlation_id TEXT NOT NULL,
    expires_ms INTEGER NOT NULL, PRIMARY KEY (tenant, bk));
CREATE TABLE IF NOT EXISTS timers (
    kind TEXT NOT NULL, member TEXT NOT NULL, at_ms INTEGER NOT NULL,
    PRIMARY KEY (kind, member));
CREATE INDEX IF NOT EXISTS timers_due ON timers(kind, at_ms);
CREATE TABLE IF NOT EXISTS nonces (key TEXT PRIMARY KEY, expires_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL, key TEXT NOT NULL, session_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL, status TEXT NOT NULL, expires_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, key));
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL, held INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(held, expires_ms);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL,
    generation INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_state ON sessions(tenant, state, session_id);
CREATE INDEX IF NOT EXISTS sessions_by_tenant ON sessions(tenant, session_id);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _wall_ms() -> int:
    """Wall-clock ms for TTL-style expiry (nonces, idempotency keys), as Redis uses."""
    return int(time.time() * 1000)


class SqliteIndex:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torpor-sqlite")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = self._executor.submit(self._connect).result()
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"SQLite index at {self.path} cannot be opened: {exc}") from exc

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 30000")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        # Several processes may open a fresh file at once: create the schema under the
        # write lock, in one transaction.
        conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        return conn

    @property
    def url(self) -> str:
        return f"sqlite://{self.path}"

    async def _run(self, fn: Callable[[sqlite3.Connection], T], *, write: bool = True) -> T:
        def call() -> T:
            conn = self._conn
            if not write:
                return fn(conn)
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return out

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.OperationalError as exc:
            raise IndexUnavailable(f"SQLite index at {self.path} failed: {exc}") from exc

    async def ping(self) -> None:
        await self._run(lambda c: c.execute("SELECT 1").fetchone(), write=False)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=False)

    # -- waits --------------------------------------------------------------------------

    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta
    ) -> None:
        expires = to_ms(binding.deadline + grace)
        encoded = encode_binding(binding, expires_ms=expires)

        def op(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO bindings VALUES (?,?,?,?,?) ON CONFLICT(correlation_id) DO UPDATE "
                "SET tenant=excluded.tenant, encoded=excluded.encoded, "
                "deadline_ms=excluded.deadline_ms, expires_ms=excluded.expires_ms",
                (binding.correlation_id, binding.tenant, encoded, to_ms(binding.deadline), expires),
            )
            if business_key:
                c.execute(
                    "INSERT INTO business_keys VALUES (?,?,?,?) ON CONFLICT(tenant, bk) DO UPDATE "
                    "SET correlation_id=excluded.correlation_id, expires_ms=excluded.expires_ms",
                    (binding.tenant, digest(business_key), binding.correlation_id, expires),
                )

        await self._run(op)

    async def resolve(
        self, *, tenant: str, correlation_id: str | None = None, business_key: str | None = None
    ) -> WaitBinding | None:
        now = _wall_ms()

        def op(c: sqlite3.Connection) -> WaitBinding | None:
            cid = correlation_id
            if cid is None and business_key is not None:
                row = c.execute(
                    "SELECT correlation_id FROM business_keys "
                    "WHERE tenant=? AND bk=? AND expires_ms>?",
                    (tenant, digest(business_key), now),
                ).fetchone()
                cid = row[0] if row else None
            if cid is None:
                return None
            row = c.execute(
                "SELECT encoded FROM bindings WHERE correlation_id=? AND tenant=? AND expires_ms>?",
                (cid, tenant, now),
            ).fetchone()
            stored = decode_binding(cid, row[0]) if row else None
            return stored.binding if stored else None

        return await self._run(op, write=False)

    async def unbind(self, *, tenant: str, correlation_id: str, business_key: str | None) -> None:
        def op(c: sqlite3.Connection) -> None:
            c.execute(
                "DELETE FROM bindings WHERE correlation_id=? AND tenant=?", (correlation_id, tenant)
            )
            # Only the pointer that still names this wait: a newer wait may own the key.
            c.execute(
                "DELETE FROM business_keys WHERE tenant=? AND correlation_id=?",
                (tenant, correlation_id),
            )

        await self._run(op)

    async def due_deadlines(self, *, now: datetime, limit: int) -> list[WaitBinding]:
        wall = _wall_ms()

        def op(c: sqlite3.Connection) -> list[WaitBinding]:
            # Entries past deadline + grace are collected here, as Redis' TTL would.
            c.execute("DELETE FROM bindings WHERE expires_ms<=?", (wall,))
            c.execute("DELETE FROM business_keys WHERE expires_ms<=?", (wall,))
            rows = c.execute(
                "SELECT correlation_id, encoded FROM bindings WHERE deadline_ms<=? "
                "ORDER BY deadline_ms LIMIT ?",
                (to_ms(now), limit),
            ).fetchall()
            return [s.binding for cid, raw in rows if (s := decode_binding(cid, raw)) is not None]

        return await self._run(op)

    # -- timers -------------------------------------------------------------------------

    async def schedule(self, *, kind: TimerKind, member: str, at: datetime) -> None:
        await self._run(
            lambda c: c.execute(
                "INSERT INTO timers VALUES (?,?,?) ON CONFLICT(kind, member) "
                "DO UPDATE SET at_ms=excluded.at_ms",
                (kind.value, member, to_ms(at)),
            )
        )

    async def unschedule(self, *, kind: TimerKind, member: str) -> None:
        await self._run(
            lambda c: c.execute(
                "DELETE FROM timers WHERE kind=? AND member=?", (kind.value, member)
            )
        )

    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        rows = await self._run(
            lambda c: c.execute(
                "SELECT member FROM timers WHERE kind=? AND at_ms<=? ORDER BY at_ms LIMIT ?",
                (kind.value, to_ms(now), limit),
            ).fetchall(),
            write=False,
        )
        return [r[0] for r in rows]

    # -- dedupe and idempotency ---------------------------------------------------------

    async def claim_nonce(self, *, scope: str, nonce: str, ttl: timedelta) -> bool:
        key = f"{scope}:{digest(nonce)}"
        now = _wall_ms()

        def op(c: sqlite3.Connection) -> bool:
            c.execute("DELETE FROM nonces WHERE key=? AND expires_ms<=?", (key, now))
            cur = c.execute(
                "INSERT INTO nonces VALUES (?,?) ON CONFLICT(key) DO NOTHING",
                (key, now + _ms(ttl)),
            )
            return cur.rowcount == 1

        return await self._run(op)

    async def claim_nonces(self, claims: list[tuple[str, str]], *, ttl: timedelta) -> bool:
        keys = [f"{scope}:{digest(nonce)}" for scope, nonce in claims]
        now = _wall_ms()

        def op(c: sqlite3.Connection) -> bool:
            for key in keys:
                c.execute("DELETE FROM nonces WHERE key=? AND expires_ms<=?", (key, now))
                if c.execute("SELECT 1 FROM nonces WHERE key=?", (key,)).fetchone():
                    return False
            c.executemany(
                "INSERT INTO nonces VALUES (?,?)", [(key, now + _ms(ttl)) for key in keys]
            )
            return True

        return await self._run(op)

    async def admit(
        self,
        *,
        claims: list[tuple[str, str]],
        ttl: timedelta,
        tenant: str,
        correlation_id: str | None,
        business_key: str | None,
    ) -> Admission:
        # One local transaction each: no round trips to save here.
        if not await self.claim_nonces(claims, ttl=ttl):
            return Admission(False, None)
        binding = await self.resolve(
            tenant=tenant, correlation_id=correlation_id, business_key=business_key
        )
        return Admission(True, binding)

    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        key = f"{scope}:{digest(nonce)}"
        await self._run(lambda c: c.execute("DELETE FROM nonces WHERE key=?", (key,)))

    async def claim_idempotency(
        self, *, tenant: str, key: str, fingerprint: str, session_id: str, ttl: timedelta
    ) -> IdempotencyRecord:
        hkey = digest(key)
        now = _wall_ms()

        def op(c: sqlite3.Connection) -> IdempotencyRecord:
            c.execute(
                "DELETE FROM idempotency WHERE tenant=? AND key=? AND expires_ms<=?",
                (tenant, hkey, now),
            )
            cur = c.execute(
                "INSERT INTO idempotency VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                (tenant, hkey, session_id, fingerprint, "in_progress", now + _ms(ttl)),
            )
            if cur.rowcount == 1:
                return IdempotencyRecord(
                    key, session_id, fingerprint, IdempotencyStatus.IN_PROGRESS, True
                )
            sid, fp, status = c.execute(
                "SELECT session_id, fingerprint, status FROM idempotency WHERE tenant=? AND key=?",
                (tenant, hkey),
            ).fetchone()
            return IdempotencyRecord(key, sid, fp, IdempotencyStatus(status), False)

        return await self._run(op)

    async def finish_idempotency(self, *, tenant: str, key: str, ttl: timedelta) -> None:
        expires = _wall_ms() + _ms(ttl)
        await self._run(
            lambda c: c.execute(
                "UPDATE idempotency SET status='done', expires_ms=? WHERE tenant=? AND key=?",
                (expires, tenant, digest(key)),
            )
        )

    async def release_idempotency(self, *, tenant: str, key: str) -> None:
        await self._run(
            lambda c: c.execute(
                "DELETE FROM idempotency WHERE tenant=? AND key=?", (tenant, digest(key))
            )
        )

    # -- leases -------------------------------------------------------------------------

    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None:
        now_ms, exp = to_ms(now), to_ms(now) + _ms(ttl)

        def op(c: sqlite3.Connection) -> Lease | None:
            row = c.execute("SELECT token, expires_ms, held FROM leases WHERE name=?", (name,))
            current = row.fetchone()
            if current is not None and current[2] and current[1] > now_ms:
                return None
            # The token survives release, so it only ever grows: that is the fence.
            token = (current[0] if current else 0) + 1
            c.execute(
                "INSERT INTO leases VALUES (?,?,?,?,1) ON CONFLICT(name) DO UPDATE SET "
                "owner=excluded.owner, token=excluded.token, "
                "expires_ms=excluded.expires_ms, held=1",
                (name, owner, token, exp),
            )
            return Lease(name, owner, token, from_ms(exp))

        return await self._run(op)

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        exp = to_ms(now) + _ms(ttl)
        cur = await self._run(
            lambda c: c.execute(
                "UPDATE leases SET expires_ms=? WHERE name=? AND owner=? AND token=? AND held=1",
                (exp, lease.name, lease.owner, lease.token),
            )
        )
        return Lease(lease.name, lease.owner, lease.token, from_ms(exp)) if cur.rowcount else None

    async def release_lease(self, lease: Lease) -> bool:
        cur = await self._run(
            lambda c: c.execute(
                "UPDATE leases SET held=0 WHERE name=? AND owner=? AND token=? AND held=1",
                (lease.name, lease.owner, lease.token),
            )
        )
        return cur.rowcount == 1

    async def expired_leases(self, *, now: datetime, limit: int) -> list[str]:
        rows = await self._run(
            lambda c: c.execute(
                "SELECT name FROM leases WHERE held=1 AND expires_ms<=? ORDER BY expires_ms "
                "LIMIT ?",
                (to_ms(now), limit),
            ).fetchall(),
            write=False,
        )
        return [r[0] for r in rows]

    async def forget_lease(self, *, name: str, now: datetime) -> None:
        await self._run(
            lambda c: c.execute(
                "UPDATE leases SET held=0 WHERE name=? AND held=1 AND expires_ms<=?",
                (name, to_ms(now)),
            )
        )

    # -- session registry ---------------------------------------------------------------

    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> None:
        # Last generation wins: an older snapshot's state never overwrites a newer one.
        await self._run(
            lambda c: c.execute(
                "INSERT INTO sessions VALUES (?,?,?,?) ON CONFLICT(session_id) "
                "DO UPDATE SET state=excluded.state, generation=excluded.generation "
                "WHERE excluded.generation >= sessions.generation",
                (session_id, tenant, state.value, generation),
            )
        )

    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]:
        def op(c: sqlite3.Connection) -> dict[str, SessionState]:
            out: dict[str, SessionState] = {}
            for start in range(0, len(session_ids), 500):  # stay under SQLite's variable limit
                chunk = session_ids[start : start + 500]
                marks = ",".join("?" * len(chunk))
                query = f"SELECT session_id, state FROM sessions WHERE session_id IN ({marks})"  # noqa: S608
                out.update({sid: SessionState(st) for sid, st in c.execute(query, chunk)})
            return out

        return await self._run(op, write=False)

    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage:
        clauses, args = ["tenant=?"], [tenant]
        if state is not None:
            clauses.append("state=?")
            args.append(state.value)
        if cursor:
            clauses.append("session_id<?")
            args.append(cursor)
        query = (
            f"SELECT session_id FROM sessions WHERE {' AND '.join(clauses)} "  # noqa: S608
            "ORDER BY session_id DESC LIMIT ?"
        )
        params: list[Any] = [*args, limit + 1]
        rows = await self._run(lambda c: c.execute(query, params).fetchall(), write=False)
        ids = [r[0] for r in rows[:limit]]
        return SessionPage(ids, ids[-1] if len(rows) > limit else None)

    # -- counters and integrity ---------------------------------------------------------

    async def incr(self, name: str, by: int = 1) -> int:
        def op(c: sqlite3.Connection) -> int:
            c.execute(
                "INSERT INTO counters VALUES (?,?) ON CONFLICT(name) "
                "DO UPDATE SET value=value+excluded.value",
                (name, by),
            )
            return int(c.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()[0])

        return await self._run(op)

    async def counters(self) -> dict[str, int]:
        rows = await self._run(
            lambda c: c.execute("SELECT name, value FROM counters").fetchall(), write=False
        )
        return {name: int(value) for name, value in rows}

    async def mark_intact(self) -> None:
        await self._run(lambda c: c.execute("INSERT OR REPLACE INTO meta VALUES ('intact', '1')"))

    async def is_intact(self) -> bool:
        row = await self._run(
            lambda c: c.execute("SELECT 1 FROM meta WHERE key='intact'").fetchone(), write=False
        )
        return row is not None


def _ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))
