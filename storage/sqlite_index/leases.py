"""Leases with fencing tokens in SQLite: one row per name, ``held`` cleared on release.

``held`` is 1 for a lease in the expiry set (what ``expired_leases`` lists), 2 for one
still held but forgotten there (``forget_lease``: its session was dealt with), 0 once
released. A forgotten lease is still its holder's, as in the Redis and memory indexes:
a late heartbeat whom nobody replaced renews it (and puts it back in the set) and its
holder can release it.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime, timedelta

from storage.sqlite_index.connection import SqliteConnection, ms
from torpor.clock import from_ms, to_ms
from torpor.ports import Lease


class SqliteLeases(SqliteConnection):
    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None:
        now_ms, exp = to_ms(now), to_ms(now) + ms(ttl)

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
            # Still held (1, or 2 once forgotten) but expired: its holder never released it.
            taken_over = current is not None and bool(current[2])
            return Lease(name, owner, token, from_ms(exp), taken_over=taken_over)

        return await self._run(op)

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        exp = to_ms(now) + ms(ttl)
        cur = await self._run(
            lambda c: c.execute(
                "UPDATE leases SET expires_ms=?, held=1 "
                "WHERE name=? AND owner=? AND token=? AND held>0",
                (exp, lease.name, lease.owner, lease.token),
            )
        )
        return Lease(lease.name, lease.owner, lease.token, from_ms(exp)) if cur.rowcount else None

    async def raise_fence(
        self, lease: Lease, *, floor: int, ttl: timedelta, now: datetime
    ) -> Lease | None:
        # The row's token is the name's counter (it survives release); while the lease is
        # ours it equals ``lease.token``, so the new token is max(ours, floor) + 1.
        token, exp = max(lease.token, floor) + 1, to_ms(now) + ms(ttl)
        cur = await self._run(
            lambda c: c.execute(
                "UPDATE leases SET token=?, expires_ms=?, held=1 "
                "WHERE name=? AND owner=? AND token=? AND held>0",
                (token, exp, lease.name, lease.owner, lease.token),
            )
        )
        return Lease(lease.name, lease.owner, token, from_ms(exp)) if cur.rowcount else None

    async def release_lease(self, lease: Lease) -> bool:
        cur = await self._run(
            lambda c: c.execute(
                "UPDATE leases SET held=0 WHERE name=? AND owner=? AND token=? AND held>0",
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

    async def drop_lease(self, *, name: str) -> None:
        await self._run(lambda c: c.execute("DELETE FROM leases WHERE name=?", (name,)))

    async def forget_lease(self, *, name: str, now: datetime) -> None:
        await self._run(
            lambda c: c.execute(
                "UPDATE leases SET held=2 WHERE name=? AND held=1 AND expires_ms<=?",
                (name, to_ms(now)),
            )
        )
