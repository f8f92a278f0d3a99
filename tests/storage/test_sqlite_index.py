"""The embedded index's failures: a damaged file or a refusing disk is ``IndexUnavailable``
with SQLite's own reason, never a raw ``sqlite3`` error (a 500 and a traceback)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from storage.sqlite_index import SqliteIndex, connection
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2020, 1, 1, tzinfo=UTC)
RUNNING = SessionState.RUNNING
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


# A child whose files may not grow past the index's log as it is once opened, so the
# next frames written to the log fail (EFBIG: SQLite's "disk I/O error"). A cache of a
# few pages makes a write spill its pages into the log mid-transaction, as a large one's
# do, so the disk refuses a statement rather than the commit.
REFUSED_MIDWAY = """
import asyncio, os, resource, signal, sys
from storage.sqlite_index import SqliteIndex
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState

async def main(path):
    index = SqliteIndex(path)
    index._conn.execute("PRAGMA cache_size=10")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    log = os.path.getsize(path + "-wal")
    resource.setrlimit(resource.RLIMIT_FSIZE, (log, resource.RLIM_INFINITY))
    try:
        await index.record_session(
            tenant="acme", session_id="s" * 200_000, state=SessionState.RUNNING, generation=1
        )
    except IndexUnavailable as exc:
        print(exc)

asyncio.run(main(sys.argv[1]))
"""


def test_a_write_the_disk_refuses_midway_is_reported_with_the_disks_reason(
    tmp_path: Path,
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", REFUSED_MIDWAY, str(tmp_path / "index.db")],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    reported = child.stdout.decode()
    assert "disk I/O error" in reported, reported
    assert "rollback" not in reported, reported


# Another process that takes the index's write lock and keeps it until its stdin closes
# (stopped, or stuck on its disk, inside a transaction).
HOLDS_THE_WRITE_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.read()
"""


async def test_changes_queued_behind_a_held_write_lock_each_give_up_at_their_own_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker thread runs the index's calls in turn: each change that waited out its
    busy timeout there made every one queued behind it start its own, so the n-th of a
    burst answered after n timeouts."""
    monkeypatch.setattr(connection, "BUSY_TIMEOUT_S", 0.5)
    path = tmp_path / "index.db"
    index = SqliteIndex(path)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THE_WRITE_LOCK, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"

        async def waited(n: int) -> float:
            asked = time.monotonic()
            with pytest.raises(IndexUnavailable, match="locked"):
                await index.record_session(
                    tenant="acme", session_id=f"s{n}", state=SessionState.RUNNING, generation=1
                )
            return time.monotonic() - asked

        waits = await asyncio.gather(*(waited(n) for n in range(6)))
        assert max(waits) < 3 * connection.BUSY_TIMEOUT_S, waits  # 6 in turn: 6 of them
    finally:
        holder.communicate(b"", timeout=10)
        await index.close()


def test_a_forked_child_uses_the_index_through_its_own_connection(tmp_path: Path) -> None:
    """A child forked from a process that used the index: the parent's worker thread is
    not the child's (a pool that counted it would start none and queue every call for
    ever), nor is its connection (SQLite's locks are the parent's)."""
    index = SqliteIndex(tmp_path / "index.db")
    first = index.record_session(tenant="acme", session_id="parent", state=RUNNING, generation=1)
    asyncio.run(first)
    pid = os.fork()
    if pid == 0:  # the child: any failure is its exit status
        code = 1
        try:

            async def child() -> None:
                await index.record_session(
                    tenant="acme", session_id="child", state=RUNNING, generation=1
                )
                assert await index.session_generation("parent") == 1

            asyncio.run(asyncio.wait_for(child(), timeout=5))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    async def parent() -> None:
        assert await index.session_generation("child") == 1
        await index.record_session(tenant="acme", session_id="again", state=RUNNING, generation=1)
        await index.close()

    asyncio.run(parent())


def connections_to(path: Path) -> int:
    """How many of this process's descriptors are open on ``path`` (a connection holds
    one on its database file while it is open)."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


async def test_an_index_used_again_after_close_opens_again(tmp_path: Path) -> None:
    """A call that comes after ``close`` (a request still in flight at shutdown) is
    answered, as the memory and Redis indexes and the local store answer it; it was a
    RuntimeError from a worker already shut down. The next ``close`` closes it too."""
    path = tmp_path / "index.db"
    index = SqliteIndex(path)
    await index.record_session(tenant="acme", session_id="s", state=RUNNING, generation=1)
    await index.close()
    assert connections_to(path) == 0
    assert await index.session_generation("s") == 1
    await index.record_session(tenant="acme", session_id="t", state=RUNNING, generation=1)
    await index.close()
    assert connections_to(path) == 0
