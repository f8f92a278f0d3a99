"""Timers in SQLite: one row per (kind, member), indexed by due time."""

from __future__ import annotations

from datetime import datetime

from storage.sqlite_index.connection import SqliteConnection
from torpor.clock import to_ms
from torpor.ports import TimerKind


class SqliteTimers(SqliteConnection):
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
