"""Timers in SQLite: one row per (kind, member), indexed by due time."""

from __future__ import annotations

import sqlite3
from datetime import datetime

from storage.sqlite_index.connection import SqliteConnection
from torpor.clock import to_ms
from torpor.ports import TimerKind

_SCHEDULE = (
    "INSERT INTO timers VALUES (?,?,?) ON CONFLICT(kind, member) DO UPDATE SET at_ms=excluded.at_ms"
)
_SCHEDULE_KEEP_EARLIER = (
    "INSERT INTO timers VALUES (?,?,?) ON CONFLICT(kind, member) "
    "DO UPDATE SET at_ms=min(at_ms, excluded.at_ms)"
)
_SCHEDULE_IF_ABSENT = "INSERT INTO timers VALUES (?,?,?) ON CONFLICT(kind, member) DO NOTHING"
# Ties in member order, as Redis' sorted set and the memory index give them: which of
# several timers due at once a limited take gets does not depend on the index.
_DUE = "SELECT member FROM timers WHERE kind=? AND at_ms<=? ORDER BY at_ms, member LIMIT ?"


class SqliteTimers(SqliteConnection):
    async def schedule(
        self,
        *,
        kind: TimerKind,
        member: str,
        at: datetime,
        keep_earlier: bool = False,
        if_absent: bool = False,
    ) -> None:
        if keep_earlier and if_absent:
            raise ValueError("keep_earlier and if_absent exclude each other")
        sql = _SCHEDULE
        if keep_earlier or if_absent:
            sql = _SCHEDULE_KEEP_EARLIER if keep_earlier else _SCHEDULE_IF_ABSENT
        await self._run(lambda c: c.execute(sql, (kind.value, member, to_ms(at))))

    async def unschedule(
        self, *, kind: TimerKind, member: str, if_at: datetime | None = None
    ) -> None:
        sql = "DELETE FROM timers WHERE kind=? AND member=?"
        args: list[str | int] = [kind.value, member]
        if if_at is not None:  # only if nobody moved it since it was leased at ``if_at``
            sql, args = sql + " AND at_ms=?", [*args, to_ms(if_at)]
        await self._run(lambda c: c.execute(sql, args))

    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        rows = await self._run(
            lambda c: c.execute(
                _DUE,
                (kind.value, to_ms(now), limit),
            ).fetchall(),
            write=False,
        )
        return [r[0] for r in rows]

    async def lease_due(
        self, *, kind: TimerKind, now: datetime, limit: int, until: datetime
    ) -> list[str]:
        def op(c: sqlite3.Connection) -> list[str]:
            # One write transaction: two takers never both get a member.
            rows = c.execute(
                _DUE,
                (kind.value, to_ms(now), limit),
            ).fetchall()
            members = [r[0] for r in rows]
            c.executemany(
                "UPDATE timers SET at_ms=? WHERE kind=? AND member=?",
                [(to_ms(until), kind.value, m) for m in members],
            )
            return members

        return await self._run(op)
