"""What every role of the SQLite index shares: one connection, one worker thread, the schema.

WAL mode lets readers run beside one writer; every change is one ``BEGIN IMMEDIATE``
transaction, so it takes the database's write lock up front and processes on the same
host serialise on it (``busy_timeout`` makes them wait instead of failing, for at most
``BUSY_TIMEOUT_S`` from the call's ask, its turn on the worker thread included). A
conditional change decides by the row count of its ``INSERT … ON CONFLICT`` or
``UPDATE … WHERE``, never by a read followed by a separate write.

sqlite3 blocks, so each index owns one connection used from one worker thread (a forked
child makes both anew, ``_forked``: neither the parent's thread nor its locks are the
child's). Expiry is always decided against the caller's ``now``, never the wall clock. A
failure of the file or of the disk under it (locked past ``busy_timeout``, full,
read-only, damaged) is ``IndexUnavailable``, with SQLite's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from torpor.errors import ConfigError, IndexUnavailable

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bindings (
    correlation_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, encoded TEXT NOT NULL,
    deadline_ms INTEGER NOT NULL, expires_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS bindings_deadline ON bindings(deadline_ms);
-- Expiry indexes: the deadline loop (4 times a second) collects expired bindings and
-- pointers, a claim expired nonces and idempotency keys; an unbind (every resume) drops
-- the pointer naming its wait. Each by index, not a scan of every wait bound. A file made
-- before they existed gets them at its next open.
CREATE INDEX IF NOT EXISTS bindings_expiry ON bindings(expires_ms);
CREATE TABLE IF NOT EXISTS business_keys (
    tenant TEXT NOT NULL, bk TEXT NOT NULL, correlation_id TEXT NOT NULL,
    expires_ms INTEGER NOT NULL, PRIMARY KEY (tenant, bk));
CREATE INDEX IF NOT EXISTS business_keys_wait ON business_keys(tenant, correlation_id);
CREATE INDEX IF NOT EXISTS business_keys_expiry ON business_keys(expires_ms);
CREATE TABLE IF NOT EXISTS timers (
    kind TEXT NOT NULL, member TEXT NOT NULL, at_ms INTEGER NOT NULL,
    PRIMARY KEY (kind, member));
CREATE INDEX IF NOT EXISTS timers_due ON timers(kind, at_ms);
CREATE TABLE IF NOT EXISTS nonces (key TEXT PRIMARY KEY, expires_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces(expires_ms);
CREATE TABLE IF NOT EXISTS idempotency (
    tenant TEXT NOT NULL, key TEXT NOT NULL, session_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL, status TEXT NOT NULL, expires_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, key));
CREATE INDEX IF NOT EXISTS idempotency_expiry ON idempotency(expires_ms);
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY, owner TEXT NOT NULL, token INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL, held INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS leases_expiry ON leases(held, expires_ms);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL,
    generation INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_by_state ON sessions(tenant, state, session_id);
CREATE INDEX IF NOT EXISTS sessions_by_tenant ON sessions(tenant, session_id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


OPEN_RETRY_S = 30.0
_INHERITED: list[sqlite3.Connection] = []  # a forked parent's, in use at the fork
# How long a change waits for the write lock that another process holds, from its ask.
BUSY_TIMEOUT_S = 30.0


class SqliteConnection:
    """The state the role mixins share; ``SqliteIndex`` composes them over one of these."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._executor = worker()
        self._in_use = threading.Lock()  # held by the worker thread while it uses _conn
        self._conn: sqlite3.Connection | None = None  # None: opened by the next call
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = self._executor.submit(self._connect).result()
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"SQLite index at {self.path} cannot be opened: {exc}") from exc
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def _close_connection(self) -> None:
        """Closed after the calls asked before (a worker's queue is in order); the next
        call opens one again."""
        with self._in_use:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _connection(self) -> sqlite3.Connection:
        """The connection, opened on the worker thread if a fork or ``close`` left none."""
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _connect(self) -> sqlite3.Connection:
        # Switching a fresh file to WAL while another process does the same can fail with
        # "database is locked" at once, without waiting out busy_timeout (SQLite does not
        # call the busy handler for that lock): try again, for as long as busy_timeout.
        deadline = time.monotonic() + OPEN_RETRY_S
        while True:
            try:
                return self._open()
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            # Several processes may open a fresh file at once: create the schema under the
            # write lock, in one transaction.
            conn.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def url(self) -> str:
        return f"sqlite://{self.path}"

    async def _run(self, fn: Callable[[sqlite3.Connection], T], *, write: bool = True) -> T:
        # Counted from the ask, not from the worker thread's turn: behind a change that
        # waited out its whole busy timeout, each queued one waited out a whole one of its
        # own, and the n-th of a burst answered after n of them.
        deadline = time.monotonic() + BUSY_TIMEOUT_S

        def call() -> T:
            with self._in_use:
                conn = self._connection()
                # A reader too: it waits for no writer (WAL), but may for another
                # process's recovery of the log after a crash.
                left_ms = max(0, int((deadline - time.monotonic()) * 1000))
                conn.execute(f"PRAGMA busy_timeout = {left_ms}")  # 0: the lock now, or never
                if not write:
                    return fn(conn)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(conn)
                except BaseException:
                    _roll_back(conn)
                    raise
                conn.execute("COMMIT")
                return out

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.DatabaseError as exc:
            if not _unavailable(exc):
                raise
            raise IndexUnavailable(f"SQLite index at {self.path} failed: {exc}") from exc


def worker() -> ThreadPoolExecutor:
    """The one thread an index's calls run on (started by its first call)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="torpor-sqlite")


def _forked(ref: weakref.ref[SqliteConnection]) -> None:
    """In a forked child: a worker of its own, and its copy of the parent's connection
    closed before the child opens one (its next call). The parent's worker thread is not
    the child's: the pool counted it, started none, and every call waited for ever. And
    SQLite keeps a process's locks in the library's memory, by file: the copy says it
    holds the parent's, which the kernel does not give a child, and a connection opened
    beside it would take none. One the parent's thread was using at the fork is left
    open, untouched: its state, and the mutex SQLite holds for it, are that thread's."""
    index = ref()
    if index is None:
        return
    if index._conn is not None:
        if index._in_use.locked():
            _INHERITED.append(index._conn)
        else:
            with contextlib.suppress(sqlite3.Error):
                index._conn.close()
    index._conn = None
    index._executor = worker()
    index._in_use = threading.Lock()


def _roll_back(conn: sqlite3.Connection) -> None:
    """End the failed transaction, if SQLite has not. After an I/O error or a full disk
    SQLite rolls it back itself, and a ROLLBACK then fails ("no transaction is active"):
    raised, its error replaced the one that said why the write failed."""
    if conn.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def _unavailable(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite failed for the file or the disk under it (locked, full, read-only,
    an I/O error, damaged pages), not for the statement asked of it: the index is
    unavailable, not wrong. A damaged page raises a bare ``DatabaseError``, not an
    ``OperationalError``, and reached the caller raw (a 500 and a traceback)."""
    if isinstance(exc, sqlite3.OperationalError):
        return True
    code = getattr(exc, "sqlite_errorcode", -1) & 0xFF
    return code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


def ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))
