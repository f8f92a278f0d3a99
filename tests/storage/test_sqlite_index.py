"""The embedded index's failures: a damaged file or a refusing disk is ``IndexUnavailable``
with SQLite's own reason, never a raw ``sqlite3`` error (a 500 and a traceback)."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from storage.sqlite_index import SqliteIndex
from torpor.errors import IndexUnavailable

NOW = datetime(2020, 1, 1, tzinfo=UTC)
TTL = timedelta(days=1)


async def admit(index: SqliteIndex, nonce: str) -> bool:
    admission = await index.admit(
        claims=[("hook:gh", nonce)],
        ttl=TTL,
        now=NOW,
        tenant="acme",
        correlation_id=None,
        business_key=None,
    )
    return admission.fresh


def damage_table(path: Path, table: str) -> None:
    """Overwrite ``table``'s root page with bytes no b-tree page holds (a bad sector)."""
    with closing(sqlite3.connect(path)) as db:
        [(root,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (table,))
        [(page_size,)] = db.execute("PRAGMA page_size")
    with open(path, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(b"\xff" * page_size)


async def test_a_damaged_page_is_the_index_unavailable_not_a_raw_sqlite_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "index.db"
    index = SqliteIndex(path)
    for n in range(500):  # a root page with children: the claim reads through it
        assert await admit(index, f"old-{n}")
    await index.close()  # the last connection: every commit is in the file, the log gone
    damage_table(path, "nonces")
    index = SqliteIndex(path)
    try:
        with pytest.raises(IndexUnavailable, match="malformed"):
            await admit(index, "new")
    finally:
        await index.close()
