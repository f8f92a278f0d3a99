"""Reachability, shutdown and the integrity marker of the SQLite index."""

from __future__ import annotations

import asyncio

from storage.sqlite_index.connection import SqliteConnection


class SqliteHealth(SqliteConnection):
    async def ping(self) -> None:
        await self._run(lambda c: c.execute("SELECT 1").fetchone(), write=False)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._conn.close)
        self._executor.shutdown(wait=False)

    async def mark_intact(self) -> None:
        await self._run(lambda c: c.execute("INSERT OR REPLACE INTO meta VALUES ('intact', '1')"))

    async def is_intact(self) -> bool:
        row = await self._run(
            lambda c: c.execute("SELECT 1 FROM meta WHERE key='intact'").fetchone(), write=False
        )
        return row is not None
