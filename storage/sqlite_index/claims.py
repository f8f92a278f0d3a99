"""Replay nonces and idempotency keys in SQLite: first claim wins until it expires.

Each row carries its expiry (the caller's ``now`` + ttl); an expired row is deleted in the
same transaction that would claim it, as Redis' TTL would have dropped it. Each claim also
deletes a bounded batch of other expired rows: a key is rarely claimed twice (a webhook's
content digest, a request's idempotency key), so rows left for their own next claim were
never deleted and the tables grew with every request ever taken.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta
from typing import Literal

from storage.sqlite_index.connection import SqliteConnection, ms
from storage.sqlite_index.waits import lookup
from torpor.clock import to_ms
from torpor.ids import digest
from torpor.ports import Admission, IdempotencyRecord, IdempotencyStatus

# Expired rows deleted by one claim: more than a claim adds (one or two rows), so the
# tables shrink back to their live rows, and few enough to keep the claim's transaction
# short after a long quiet spell left many.
PURGE_BATCH = 64


def _nonce_key(scope: str, nonce: str) -> str:
    return f"{scope}:{digest(nonce)}"


def _purge(c: sqlite3.Connection, table: Literal["nonces", "idempotency"], now_ms: int) -> None:
    """Delete up to ``PURGE_BATCH`` of ``table``'s expired rows (by its expiry index)."""
    c.execute(
        f"DELETE FROM {table} WHERE rowid IN "  # noqa: S608 (a table name of ours, not input)
        f"(SELECT rowid FROM {table} WHERE expires_ms<=? LIMIT ?)",
        (now_ms, PURGE_BATCH),
    )


class SqliteClaims(SqliteConnection):
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
        keys = [_nonce_key(scope, nonce) for scope, nonce in claims]
        now_ms = to_ms(now)

        def op(c: sqlite3.Connection) -> Admission:
            # All or none: a replay must not consume one claim of a pair and fail on the
            # other. The write lock is held from the first check to the insert.
            _purge(c, "nonces", now_ms)
            for key in keys:
                c.execute("DELETE FROM nonces WHERE key=? AND expires_ms<=?", (key, now_ms))
                if c.execute("SELECT 1 FROM nonces WHERE key=?", (key,)).fetchone():
                    return Admission(False, None)
            c.executemany(
                "INSERT INTO nonces VALUES (?,?)", [(key, now_ms + ms(ttl)) for key in keys]
            )
            binding = lookup(
                c,
                tenant=tenant,
                correlation_id=correlation_id,
                business_key=business_key,
                now_ms=now_ms,
            )
            return Admission(True, binding)

        return await self._run(op)

    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        key = _nonce_key(scope, nonce)
        await self._run(lambda c: c.execute("DELETE FROM nonces WHERE key=?", (key,)))

    async def holds_nonce(self, *, scope: str, nonce: str, now: datetime) -> bool:
        key, now_ms = _nonce_key(scope, nonce), to_ms(now)
        held = await self._run(
            lambda c: c.execute(
                "SELECT 1 FROM nonces WHERE key=? AND expires_ms>?", (key, now_ms)
            ).fetchone()
        )
        return held is not None

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
        hkey = digest(key)
        now_ms = to_ms(now)

        def op(c: sqlite3.Connection) -> IdempotencyRecord:
            _purge(c, "idempotency", now_ms)
            c.execute(
                "DELETE FROM idempotency WHERE tenant=? AND key=? AND expires_ms<=?",
                (tenant, hkey, now_ms),
            )
            cur = c.execute(
                "INSERT INTO idempotency VALUES (?,?,?,?,?,?) ON CONFLICT DO NOTHING",
                (tenant, hkey, session_id, fingerprint, "in_progress", now_ms + ms(ttl)),
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

    async def finish_idempotency(
        self, *, tenant: str, key: str, ttl: timedelta, now: datetime
    ) -> None:
        expires = to_ms(now) + ms(ttl)
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
