"""Open waits in SQLite: a bindings table and a business-key table, both with an expiry."""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta

from storage.bindings import decode_binding, encode_binding
from storage.sqlite_index.connection import SqliteConnection
from torpor.clock import from_ms, to_ms
from torpor.ids import digest
from torpor.ports import WaitBinding


def lookup(
    c: sqlite3.Connection,
    *,
    tenant: str,
    correlation_id: str | None,
    business_key: str | None,
    now_ms: int,
) -> WaitBinding | None:
    """The wait bound and unexpired at ``now_ms``, inside the caller's transaction."""
    cid = correlation_id
    if cid is None and business_key is not None:
        row = c.execute(
            "SELECT correlation_id FROM business_keys WHERE tenant=? AND bk=? AND expires_ms>?",
            (tenant, digest(business_key), now_ms),
        ).fetchone()
        cid = row[0] if row else None
    if cid is None:
        return None
    row = c.execute(
        "SELECT encoded FROM bindings WHERE correlation_id=? AND tenant=? AND expires_ms>?",
        (cid, tenant, now_ms),
    ).fetchone()
    stored = decode_binding(cid, row[0]) if row else None
    return stored.binding if stored else None


class SqliteWaits(SqliteConnection):
    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> bool:
        # Expiry is absolute (deadline + grace); ``now`` decides whether a business key's
        # holder is still open.
        expires = to_ms(binding.deadline + grace)
        encoded = encode_binding(binding, expires_ms=expires)

        def op(c: sqlite3.Connection) -> bool:
            c.execute(
                "INSERT INTO bindings VALUES (?,?,?,?,?) ON CONFLICT(correlation_id) DO UPDATE "
                "SET tenant=excluded.tenant, encoded=excluded.encoded, "
                "deadline_ms=excluded.deadline_ms, expires_ms=excluded.expires_ms",
                (binding.correlation_id, binding.tenant, encoded, to_ms(binding.deadline), expires),
            )
            if not business_key:
                return True
            # Checked and written in one write transaction: two sessions binding the same
            # key at once cannot both take it.
            held = lookup(
                c,
                tenant=binding.tenant,
                correlation_id=None,
                business_key=business_key,
                now_ms=to_ms(now),
            )
            if held is not None and held.session_id != binding.session_id:
                return False  # another session's open wait keeps the key
            c.execute(
                "INSERT INTO business_keys VALUES (?,?,?,?) ON CONFLICT(tenant, bk) DO UPDATE "
                "SET correlation_id=excluded.correlation_id, expires_ms=excluded.expires_ms",
                (binding.tenant, digest(business_key), binding.correlation_id, expires),
            )
            return True

        return await self._run(op)

    async def mend_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> int | None:
        # A binding's row holds its deadline: only a business-key row can be missing.
        bound = binding.model_copy(update={"deadline": from_ms(to_ms(binding.deadline))})
        cid, now_ms = binding.correlation_id, to_ms(now)

        def op(c: sqlite3.Connection) -> int | None:
            held = lookup(
                c, tenant=binding.tenant, correlation_id=cid, business_key=None, now_ms=now_ms
            )
            if held != bound:
                return None
            if not business_key:
                return 0
            owner = lookup(
                c,
                tenant=binding.tenant,
                correlation_id=None,
                business_key=business_key,
                now_ms=now_ms,
            )
            if owner is not None and (
                owner.correlation_id == cid or owner.session_id != binding.session_id
            ):
                return 0  # ours already, or another session's open wait keeps it
            # As long as the binding itself lives (repair may have bound it for longer).
            [expires] = c.execute(
                "SELECT expires_ms FROM bindings WHERE correlation_id=?", (cid,)
            ).fetchone()
            c.execute(
                "INSERT INTO business_keys VALUES (?,?,?,?) ON CONFLICT(tenant, bk) DO UPDATE "
                "SET correlation_id=excluded.correlation_id, expires_ms=excluded.expires_ms",
                (binding.tenant, digest(business_key), cid, expires),
            )
            return 1

        return await self._run(op)

    async def resolve(
        self,
        *,
        tenant: str,
        now: datetime,
        correlation_id: str | None = None,
        business_key: str | None = None,
    ) -> WaitBinding | None:
        return await self._run(
            lambda c: lookup(
                c,
                tenant=tenant,
                correlation_id=correlation_id,
                business_key=business_key,
                now_ms=to_ms(now),
            ),
            write=False,
        )

    async def unbind(
        self,
        *,
        tenant: str,
        correlation_id: str,
        business_key: str | None,
        deadline: datetime | None = None,  # a hint this index needs no use of
    ) -> None:
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
        now_ms = to_ms(now)

        def op(c: sqlite3.Connection) -> list[WaitBinding]:
            # Entries past deadline + grace are collected here, as Redis' TTL would.
            c.execute("DELETE FROM bindings WHERE expires_ms<=?", (now_ms,))
            c.execute("DELETE FROM business_keys WHERE expires_ms<=?", (now_ms,))
            rows = c.execute(
                "SELECT correlation_id, encoded FROM bindings WHERE deadline_ms<=? "
                "ORDER BY deadline_ms LIMIT ?",
                (now_ms, limit),
            ).fetchall()
            return [s.binding for cid, raw in rows if (s := decode_binding(cid, raw)) is not None]

        return await self._run(op)
