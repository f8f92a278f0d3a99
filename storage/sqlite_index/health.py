"""Reachability, shutdown and the integrity marker of the SQLite index."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from datetime import datetime

from storage.sqlite_index.connection import SqliteConnection, worker
from torpor.clock import from_ms, to_ms


class SqliteHealth(SqliteConnection):
    async def ping(self) -> None:
        await self._run(lambda c: c.execute("SELECT 1").fetchone(), write=False)

    async def close(self) -> None:
        """Close the connection once the calls asked before are done. A call that comes
        after (a request still in flight at shutdown) opens it again, as the other
        indexes and the local store answer one; it was a RuntimeError from a worker
        already shut down. A later ``close`` closes that too."""
        executor, self._executor = self._executor, worker()
        await asyncio.get_running_loop().run_in_executor(executor, self._close_connection)
        executor.shutdown(wait=False)

    async def begin_repair(self) -> str:
        token = secrets.token_hex(8)
        await self._run(
            lambda c: c.execute("INSERT OR REPLACE INTO meta VALUES ('repairing', ?)", (token,))
        )
        return token

    async def mark_intact(self, token: str) -> bool:
        def mark(c: sqlite3.Connection) -> bool:
            row = c.execute("SELECT value FROM meta WHERE key='repairing'").fetchone()
            if row is None or row[0] != token:
                return False
            c.execute("INSERT OR REPLACE INTO meta VALUES ('intact', '1')")
            c.execute("DELETE FROM meta WHERE key='repairing'")
            return True

        return await self._run(mark)

    async def is_intact(self) -> bool:
        row = await self._run(
            lambda c: c.execute("SELECT 1 FROM meta WHERE key='intact'").fetchone(), write=False
        )
        return row is not None

    async def record_sweep(self, *, at: datetime) -> None:
        value = str(to_ms(at))
        await self._run(
            lambda c: c.execute("INSERT OR REPLACE INTO meta VALUES ('last_sweep', ?)", (value,))
        )

    async def last_sweep(self) -> datetime | None:
        row = await self._run(
            lambda c: c.execute("SELECT value FROM meta WHERE key='last_sweep'").fetchone(),
            write=False,
        )
        return None if row is None else from_ms(int(row[0]))
