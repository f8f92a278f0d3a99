"""The local store's per-webhook objects as rows of one SQLite table, not a file each.

Every webhook the gateway accepts creates two small objects, its inbox event and its
request's replay marker (and a marker no event names, its due entry: ``keys.replay_due``),
and adds a record to an audit block. As files
(``storage.local_store``) each object cost a temporary file readied, written and renamed
into a folder, and each webhook a flush of the store's log: 0.49-0.52 ms of CPU a
webhook in one process under load (``bench/profile_gateway.py --concurrency 32``), 0.26-
0.30 ms as rows (docs/performance-history.md, twenty-eighth pass). Here they are rows
of one table of one SQLite database in WAL mode, shared by every process on the host as
the folder is:

* create-only is the table's primary key: an INSERT that meets the key fails, so exactly
  one creator wins, whichever processes race;
* a reader never sees half a row and never waits for a writer (WAL);
* the creates waiting in one event loop share one transaction (``LocalObjectStore``
  queues them), committed without a flush (``synchronous=NORMAL``): visible to every
  process, and safe from any process's crash, at once (the kernel holds the log's pages);
  an inbox event and its audit block, both here, are then made durable by one flush;
* ``sync`` makes them durable against a power cut: one ``fdatasync`` of the database's
  log for every commit made before it, by any process, taken outside SQLite's write lock
  so no writer waits for the disk meanwhile. A committed frame leaves the log only
  through a checkpoint, which flushes the log before it copies anything and the
  database before the log is reused or emptied, so flushing the log's file covers
  every commit that preceded the flush, wherever it now lives;
* a flush that fails ends that for the rest of the boot, in every process: the kernel
  may have dropped the pages it could not write, and a later flush, by any process of
  the host, may then succeed without having written them. The failing process leaves
  ``failed-<boot>`` beside the database (``wal.record_failure``, as the folder's
  write-ahead log does for its checkpoints). Every other process looks for it at the
  end of each flush, so no flush that ends after it was made reports a commit durable,
  and its store's log's ager looks every ``wal.AGE_POLL_S`` for its health
  (``look_for_failure``). A reboot's page cache holds none of the dropped pages: another
  boot's marker counts for nothing, and the first open of the next boot removes it.

Which keys live here is fixed by their prefix (``PREFIXES``), never by size or by
caller, so every process looks for a key in the one place it can be; a listing whose
prefix spans both kinds merges the two (``LocalObjectStore.list``). Objects that an
older version wrote as files under those prefixes are moved in when a store opens the
folder (``adopt``): every process on a host must run this version or none.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

from storage import wal
from torpor.errors import EtagMismatch, StorageUnavailable
from torpor.faults import CrashPoint, crash_point

# The inbox events and replay markers, and the audit log's blocks: an event's audit
# record is written beside it, and one flush of this table's log makes both durable (as
# files and rows, each webhook waited for a flush of each). A marker's due entry
# (``keys.replay_due``) is written with it: a row too, not a file a webhook.
PREFIXES = ("inbox/", "replays/", "replays-due/", "audit/")
DATABASE = "objects.db"
# A checkpoint after this many of a process's flushes: the log stays short (a reader's
# lookups walk it) without a checkpoint's flushes on every sync.
CHECKPOINT_EVERY = 256
# A log past this size is emptied by the next checkpoint (``_truncate_log``); below it,
# the checkpoint has the next commit write the log from its start (``_restart_log``).
# Either holds every writer of the host off while it copies, and while it waits for the
# writers and readers before it (for at most the wait below). A restart comes every
# CHECKPOINT_EVERY flushes of each process, so its wait is short: one that misses its
# turn leaves the log to grow until the next.
LOG_LIMIT_BYTES = 32 * 1024 * 1024
TRUNCATE_WAIT_MS = 100
RESTART_WAIT_MS = 10
# How long a write made off the caller's thread waits for another process's transaction,
# counted from its call (its turn at the connection included).
BUSY_WAIT_MS = 30_000
ADOPT_BATCH = 1000
# Why a flush of a table's log failed, per database: for every store of this process
# that opens it (the pages the kernel dropped were this process's page cache's too).
# Other processes learn of it from the database's folder (``wal.record_failure``).
_FAILED: dict[str, str] = {}
_ELSEWHERE = "in another process of this boot"
_INHERITED: list[sqlite3.Connection] = []  # a forked parent's, in use at the fork
_EVERY: weakref.WeakSet[SmallObjects] = weakref.WeakSet()  # this process's (a fork's too)
_LEAVING: dict[int, threading.Lock] = {}  # per process: a lock a parent held is no child's


class LogUpkeep:
    """What one store's checkpoints of the table's log did, in this process
    (``LocalObjectStore.figures``; a forked child counts its own): how large the log had
    grown when each came, and how many started it again, emptied it, or missed their
    turn (writers or readers of any process held it past its wait). Restarts that keep
    missing theirs leave the log to grow, every commit appended (a flush of the disk
    that writes the file's new size too), until it is emptied past ``LOG_LIMIT_BYTES``.
    Counted by the checkpoint, which holds the waiting connection: one at a time."""

    def __init__(self) -> None:
        self.log_bytes = 0  # what the log had grown to at the last checkpoint
        self.restarts = 0
        self.truncations = 0
        self.missed = 0

    def counted(self, grown: int, *, emptied: bool, done: bool) -> None:
        self.log_bytes = grown
        if not done:
            self.missed += 1
        elif emptied:
            self.truncations += 1
        else:
            self.restarts += 1

    def figures(self) -> dict[str, int]:
        return {
            "rows_log_bytes": self.log_bytes,
            "rows_log_restarts": self.restarts,
            "rows_log_truncations": self.truncations,
            "rows_log_checkpoints_missed": self.missed,
        }


class Busy(Exception):
    """Another process holds the write lock (or the caller's thread's connection is in
    use): the call is made again in a worker thread, which may wait."""


def holds(key: str) -> bool:
    """Whether ``key`` lives here (rather than in a file of the folder)."""
    return key.startswith(PREFIXES)


def reach(prefix: str) -> tuple[bool, bool]:
    """Whether a listing of ``prefix`` can find files, and whether it can find rows."""
    if prefix.startswith(PREFIXES):
        return False, True
    return True, any(p.startswith(prefix) for p in PREFIXES)


def _after_all(prefix: str) -> str | None:
    """The least string above every key that starts with ``prefix`` (None for "")."""
    if not prefix:
        return None
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def _connect(path: str, *, busy_ms: int) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA busy_timeout={busy_ms}")
    # Checkpoints only from ``sync``, in a worker thread: one inside a commit made on the
    # caller's thread would hold its event loop for two flushes of the disk.
    db.execute("PRAGMA wal_autocheckpoint=0")
    return db


class SmallObjects:
    """The rows. Every method is blocking; ``wait=False`` ones may be called on an event
    loop's thread: they raise ``Busy`` rather than wait for another process."""

    def __init__(
        self,
        folder: str,
        *,
        flush: Callable[[int], None] = os.fdatasync,
        boot: str | None = None,
    ) -> None:
        """``flush(fd)`` makes the table's log durable (the store times it); ``boot``: the
        boot this process runs in (``wal.boot_id``), whose failed flushes count."""
        self.folder = folder
        self._flush = flush
        self.boot = boot if boot is not None else wal.boot_id()
        self.path = os.path.join(folder, DATABASE)
        self._counted = threading.Lock()
        self._flushing = threading.Lock()
        self.committed = 0  # this process's commits, numbered: a commit's ticket
        self.synced = 0  # every commit up to this ticket is durable
        self._since_checkpoint = 0
        self.upkeep = LogUpkeep()
        self._log_fd = -1
        self._pid = 0
        self._opening = threading.Lock()
        self._open()
        _EVERY.add(self)

    def _open(self) -> None:
        _leave_the_parents()  # before any connection of this process's opens
        opened: list[sqlite3.Connection] = []
        try:
            if not os.path.isdir(self.folder):
                os.makedirs(self.folder, exist_ok=True)
                # The folder's own name in the store's root, on disk before its database
                # holds anything acknowledged.
                wal.fsync_dir(os.path.dirname(self.folder))
            quick = _connect(self.path, busy_ms=0)
            opened.append(quick)
            waiting = _connect(self.path, busy_ms=BUSY_WAIT_MS)
            opened.append(waiting)
            # One process at a time: SQLite's switch into WAL mode waits for no busy
            # handler, and failed at once ("database is locked") when processes opened a
            # new folder together (a race's workers; replicas started at once).
            with open(os.path.join(self.folder, "open.lock"), "a+b") as lock:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                if waiting.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    waiting.execute("PRAGMA journal_mode=WAL")
                waiting.execute(
                    "CREATE TABLE IF NOT EXISTS objects"
                    " (key TEXT PRIMARY KEY, etag TEXT NOT NULL, data BLOB NOT NULL)"
                    " WITHOUT ROWID"
                )
                waiting.execute(
                    "CREATE TABLE IF NOT EXISTS log_starts (id INTEGER PRIMARY KEY, n INTEGER)"
                )
                # An earlier boot's failed flush no longer counts: its marker would
                # otherwise stay in the folder for good.
                wal.forget_earlier_failures(self.folder, self.boot)
            for db in (quick, waiting):
                db.execute("PRAGMA synchronous=NORMAL")
            _start_log(waiting)
            # Best effort for the caller's thread's own first frame: it never waits.
            with contextlib.suppress(sqlite3.OperationalError):
                _start_log(quick)
            wal.fsync_dir(self.folder)  # the database's name in its folder, on disk before any ack
        except BaseException as exc:
            # Closed here: a failed open left both connections open (a damaged file, a
            # full disk), two more on every use of a closed store that opens it again.
            for db in opened:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            if isinstance(exc, OSError | sqlite3.Error):
                raise StorageUnavailable(f"small objects at {self.path}: {exc}") from exc
            raise
        # Kept only once open: a failed reopen leaves the closed ones, and ``close`` and
        # the next use see a store that is still closed.
        self._quick, self._waiting = quick, waiting
        self._quick_lock = threading.Lock()
        self._waiting_lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def figures(self) -> dict[str, int]:
        """``upkeep``'s figures, this process's own: a forked child that has not used the
        store yet still holds its parent's counts (its first use resets them,
        ``_leave_the_parents``), and none of those are its checkpoints."""
        if self._pid not in (0, os.getpid()):
            return LogUpkeep().figures()
        return self.upkeep.figures()

    # -- connections ------------------------------------------------------------------

    def _db(self, wait: bool) -> _Turn:
        """A connection of this process's, held for the ``with`` block: the caller's
        thread's never waits (``Busy``), the worker threads' waits up to
        ``BUSY_WAIT_MS`` from the call for another process (``StorageUnavailable``
        then); SQLite's errors inside are those two as well."""
        return _Turn(self, wait)

    def _taken(self, wait: bool) -> tuple[threading.Lock, sqlite3.Connection]:
        """``_Turn``'s start: the connection for ``wait``, its lock acquired."""
        if self._pid != os.getpid():
            _leave_the_parents()  # a forked child: every store's, then opened anew
        if self._closed:  # used again after ``close``: open again, as the store's files do
            with self._opening:  # once, whichever threads come at once
                if self._closed:
                    self._open()
        if not wait:
            if not self._quick_lock.acquire(blocking=False):
                raise Busy
            return self._quick_lock, self._quick
        return self._waiting_lock, self._waited_for(time.monotonic() + BUSY_WAIT_MS / 1000)

    def _waited_for(self, deadline: float) -> sqlite3.Connection:
        """The waiting connection, its lock held, given what is left until ``deadline``
        to wait for another process. Counted from the call, not from its turn: behind a
        thread that waited out another process's whole transaction, each thread queued
        for the connection waited out a whole ``BUSY_WAIT_MS`` of its own, and the n-th
        write of a burst answered after n of them."""
        if not self._waiting_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise StorageUnavailable(
                f"small objects at {self.path}: no turn at the table within {BUSY_WAIT_MS} ms"
            )
        try:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            self._waiting.execute(f"PRAGMA busy_timeout={left_ms}")  # 0: the lock now, or never
        except sqlite3.Error as exc:
            self._waiting_lock.release()
            raise StorageUnavailable(f"small objects at {self.path}: {exc}") from exc
        return self._waiting

    def _ticket(self) -> int:
        with self._counted:
            self.committed += 1
            return self.committed

    # -- reads ------------------------------------------------------------------------

    def get(self, key: str, *, wait: bool) -> tuple[bytes, str] | None:
        with self._db(wait) as db:
            row = db.execute("SELECT data, etag FROM objects WHERE key = ?", (key,)).fetchone()
        return None if row is None else (bytes(row[0]), row[1])

    def keys(self, prefix: str, start_after: str | None, limit: int, *, wait: bool) -> list[str]:
        """Up to ``limit`` keys under ``prefix`` after ``start_after``, in key order (the
        order of their UTF-8 bytes, as S3 and the folder list them)."""
        sql, args = "SELECT key FROM objects WHERE key >= ?", [prefix]
        if start_after is not None:
            sql, args = sql + " AND key > ?", [*args, start_after]
        if (above := _after_all(prefix)) is not None:
            sql, args = sql + " AND key < ?", [*args, above]
        with self._db(wait) as db:
            rows = db.execute(sql + " ORDER BY key LIMIT ?", [*args, limit]).fetchall()
        return [r[0] for r in rows]

    # -- writes: each returns the commit's ticket, durable once ``sync(ticket)`` returns --

    def create(
        self, items: Sequence[tuple[str, bytes, str]], *, wait: bool
    ) -> tuple[list[bool], int]:
        """Each ``(key, data, etag)`` created unless its key exists, in one transaction:
        whether each was, and the commit's ticket."""
        made = []
        with self._db(wait) as db, _Immediate(db):
            for key, data, etag in items:
                try:
                    db.execute("INSERT INTO objects VALUES (?, ?, ?)", (key, etag, data))
                    made.append(True)
                except sqlite3.IntegrityError:
                    made.append(False)
        crash_point(CrashPoint.STORE_ROWS_COMMITTED)
        return made, self._ticket()

    def replace(self, key: str, data: bytes, etag: str, *, expect: str | None, wait: bool) -> int:
        """The object at ``key`` replaced, or created; only if its etag is ``expect``,
        when given (``EtagMismatch`` otherwise, and nothing written)."""
        with self._db(wait) as db, _Immediate(db):
            if expect is None:
                db.execute("INSERT OR REPLACE INTO objects VALUES (?, ?, ?)", (key, etag, data))
            else:
                row = db.execute("SELECT etag FROM objects WHERE key = ?", (key,)).fetchone()
                if row is None:
                    raise EtagMismatch(f"object {key!r} no longer exists", key=key)
                if row[0].strip('"') != expect.strip('"'):
                    raise EtagMismatch(f"object {key!r} changed since it was read", key=key)
                db.execute("UPDATE objects SET etag = ?, data = ? WHERE key = ?", (etag, data, key))
        return self._ticket()

    def remove(self, key: str, *, wait: bool) -> int:
        with self._db(wait) as db, _Immediate(db):
            db.execute("DELETE FROM objects WHERE key = ?", (key,))
        return self._ticket()

    def remove_if_match(self, key: str, etag: str, *, wait: bool) -> int | None:
        """The row at ``key`` removed only if its etag is ``etag``: the commit's ticket,
        or None, and nothing removed, if it changed or is gone. One statement compares
        and removes, so a replace commits wholly before it or finds no row."""
        with self._db(wait) as db, _Immediate(db):
            removed = db.execute(
                "DELETE FROM objects WHERE key = ? AND trim(etag, '\"') = ?",
                (key, etag.strip('"')),
            ).rowcount
        ticket = self._ticket()
        return ticket if removed else None

    def rename(self, key: str, to: str, *, wait: bool) -> int | None:
        """The row at ``key`` moved to ``to`` (replacing it) in one transaction; None,
        and nothing changed, if there is none."""
        with self._db(wait) as db, _Immediate(db):
            moved = db.execute(
                "INSERT OR REPLACE INTO objects SELECT ?, etag, data FROM objects WHERE key = ?",
                (to, key),
            ).rowcount
            db.execute("DELETE FROM objects WHERE key = ?", (key,))
        ticket = self._ticket()
        return ticket if moved else None

    # -- durability -------------------------------------------------------------------

    def sync(self, ticket: int) -> None:
        """Return once the commit ``ticket`` (and every commit before it) is durable."""
        if self._pid != os.getpid():
            _leave_the_parents()  # its locks may be a parent's thread's
        if self.synced >= ticket:
            return
        with self._flushing:
            if self.synced >= ticket:
                return  # a flush that covered it ended while this one waited
            failed = _FAILED.get(self.path)
            if failed is not None:
                raise _refused(self.path, failed)
            target = self.committed
            fd = self._log()
            if fd >= 0:
                try:
                    self._flush(fd)
                except OSError as exc:
                    # The kernel may have dropped the pages it could not write and report
                    # the next flush clean: that flush would cover nothing, and a log
                    # that lost a frame is read back only up to it, later commits
                    # included. No commit here is reported durable again, nor in any
                    # other process: the pages were the host's page cache's.
                    _FAILED[self.path] = exc.strerror or str(exc)
                    wal.record_failure(self.folder, self.boot)
                    raise
            # Looked for after the flush, not before: a flush that ends after another
            # process's (or another store's of this process) failed is the one that may
            # have succeeded falsely.
            if (failed := self.look_for_failure()) is not None:
                raise _refused(self.path, failed)
            self.synced = max(self.synced, target)
            self._since_checkpoint += 1

    @property
    def failed_flush(self) -> str | None:
        """Why a flush of the table's log failed in this boot, if one did in this process,
        or in another and this one has looked since (``look_for_failure``): from then on
        no commit is reported durable (``sync``), so every row write fails. No I/O: read
        by every health check."""
        return _FAILED.get(self.path)

    def look_for_failure(self) -> str | None:
        """``failed_flush``, after a look (one stat, until one is found) for the
        ``failed-<boot>`` another process's failed flush left. Made after each flush,
        and, for a process that does not write, by its store's log's ager
        (``wal.WriteAheadLog.watch``), every ``wal.AGE_POLL_S``. Never raises."""
        failed = _FAILED.get(self.path)
        if failed is None and wal.failure_recorded(self.folder, self.boot):
            failed = _FAILED.setdefault(self.path, _ELSEWHERE)
        return failed

    def checkpoint_due(self) -> bool:
        """Whether enough flushes went by for a checkpoint: True once each time, and the
        caller runs ``checkpoint`` (each flush after it asking again would send a burst
        of them to the worker threads before the first one ran)."""
        if self._since_checkpoint < CHECKPOINT_EVERY:
            return False
        self._since_checkpoint = 0
        return True

    def checkpoint(self) -> None:
        """Copy the log into the database and have the next commit write the log from its
        start again (``_restart_log``), or empty it once it has outgrown
        ``LOG_LIMIT_BYTES`` (``_truncate_log``). Most of the copy is made first without
        holding writers off. Called in a worker thread, apart from any write: it flushes
        the disk several times (twice a copy, once the new log's header), and a failure
        of it loses no commit (they are in the log, durable), so no write is reported
        failed for it."""
        with self._db(True) as db:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            grown = _size(self.path + "-wal")
            emptying = grown > LOG_LIMIT_BYTES
            if emptying:
                done = _truncate_log(db)
            else:
                done = _restart_log(db)
                if done:
                    crash_point(CrashPoint.STORE_LOG_RESTARTED)
            self.upkeep.counted(grown, emptied=emptying, done=done)
            _start_log(db)

    def _log(self) -> int:
        """A descriptor of the database's log, its name flushed into the folder when it
        is first seen (a log whose name a power cut takes holds no commits either); -1
        if there is none: nothing was written since every commit was checkpointed."""
        path = self.path + "-wal"
        try:
            named = os.stat(path)
        except FileNotFoundError:
            return -1
        if self._log_fd >= 0 and os.path.samestat(named, os.fstat(self._log_fd)):
            return self._log_fd
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1
        self._log_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        wal.fsync_dir(self.folder)
        return self._log_fd

    # -- the files an older version wrote -----------------------------------------------

    def adopt(
        self, objects: str, *, forget: Callable[[list[str]], None] = lambda keys: None
    ) -> int:
        """Move the files under ``PREFIXES`` in ``objects`` (the store's folder of files)
        into the table, once, whichever processes open the store at once: each is
        inserted unless its key is here already, made durable, its removal made durable
        by ``forget(keys)`` (the files' own log: a replay of the older version's record
        of the file after a reboot would write it again, to be moved in again, after a
        delete of its row), and only then removed. A crash midway leaves files the next
        open moves in. The number moved."""
        tops = [os.path.join(objects, p.rstrip("/")) for p in PREFIXES]
        if not any(os.path.isdir(t) for t in tops):
            return 0  # the common case: one stat per prefix
        with open(os.path.join(self.folder, "adopt.lock"), "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            moved = 0
            for top in tops:
                files = sorted(_files_under(top))
                for start in range(0, len(files), ADOPT_BATCH):
                    batch = files[start : start + ADOPT_BATCH]
                    items = []
                    for path in batch:
                        with open(path, "rb") as fh:
                            data = fh.read()
                        key = os.path.relpath(path, objects).replace(os.sep, "/")
                        digest = hashlib.md5(data, usedforsecurity=False).hexdigest()
                        items.append((key, data, f'"{digest}"'))
                    _, ticket = self.create(items, wait=True)
                    self.sync(ticket)
                    forget([key for key, _, _ in items])
                    for path in batch:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(path)
                    moved += len(batch)
                _remove_empty(top)
            return moved

    def close(self) -> None:
        self._closed = True
        for db in (self._quick, self._waiting):
            with contextlib.suppress(sqlite3.Error):
                db.close()
        # Not under a flush: a descriptor number closed under it, and reused, would be
        # flushed in its place and the commits it was for reported durable.
        with self._flushing:
            if self._log_fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._log_fd)
                self._log_fd = -1


def _leave_the_parents() -> None:
    """In a forked child, the connections it inherited closed, every store's, before it
    opens one of its own. SQLite keeps the locks its connections hold per process, in the
    library's memory, by file: the child's copy says it holds the parent's locks, which
    the kernel does not give a child. A connection the child opened beside an inherited
    one would take none, and the parent's close, finding itself the last user, would
    checkpoint and remove the table's log under the child, whose next commits go to a
    file no name leads to. Closed before the child opens any, they release nothing of
    the child's. One a parent's thread was using at the fork is left open, untouched:
    its state is that thread's, mid-call."""
    pid = os.getpid()
    with _LEAVING.setdefault(pid, threading.Lock()):
        for rows in list(_EVERY):
            if rows._pid in (0, pid):
                continue
            for db, lock in ((rows._quick, rows._quick_lock), (rows._waiting, rows._waiting_lock)):
                if lock.locked():
                    _INHERITED.append(db)
                else:
                    with contextlib.suppress(sqlite3.Error):
                        db.close()
            rows._log_fd = -1
            # Its tickets numbered on from the parent's: a flush of the one log covers the
            # commits the parent made before the fork too, and a ticket it handed out
            # (a staged row) is reached.
            # Held at the fork by a parent's thread (a flush in a worker), they would
            # stay held for ever: that thread is not here to release them.
            rows._counted, rows._flushing = threading.Lock(), threading.Lock()
            rows._opening = threading.Lock()  # a parent's thread may be reopening them
            rows._pid = pid
            rows.upkeep = LogUpkeep()  # the parent's checkpoints are not the child's
            rows._closed = True  # its next use opens its own


def _refused(path: str, failed: str) -> StorageUnavailable:
    return StorageUnavailable(
        f"small objects at {path}: a flush of the log failed ({failed});"
        " nothing committed since it can be made durable"
    )


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _restart_log(db: sqlite3.Connection) -> bool:
    """Copy the rest of the log into the database, holding writers off for as long as
    that takes, so that the next commit writes the log from its start, over blocks the
    file has. A passive checkpoint lets writers go on, so under writes that never pause
    (one webhook after another, too) a commit always came in while it ran: no writer
    ever found the log wholly copied to start it again, and every commit was appended,
    each flush of the disk then writing the file's new size too (on this machine's disk
    four pages appended and flushed took 0.24 ms, written over 0.13 ms; a webhook's
    flush 0.39-0.40 ms, docs/performance-history.md, forty-first pass), until the log
    outgrew ``LOG_LIMIT_BYTES`` and was emptied, to grow again. Whether it was."""
    return _waited_checkpoint(db, "RESTART", RESTART_WAIT_MS)


def _truncate_log(db: sqlite3.Connection) -> bool:
    """Copy all of the log into the database and empty it, holding writers off for as
    long as that takes: a log that outgrew ``LOG_LIMIT_BYTES`` (restarts that never found
    their turn) does not keep its size afterwards (98 MB for 5,000 webhooks' events of
    1.5 kB, before restarts). Whether it was."""
    return _waited_checkpoint(db, "TRUNCATE", TRUNCATE_WAIT_MS)


def _waited_checkpoint(db: sqlite3.Connection, mode: str, wait_ms: int) -> bool:
    """A checkpoint that waits at most ``wait_ms`` for the writers and readers before it.
    When the wait runs out SQLite copies what it can without holding writers off (all of
    it, if only readers were in the way, but the log is not started again or emptied)
    and says busy in the pragma's row, not with an error: the next checkpoint tries
    again. Whether it was not busy: the log was started again or emptied. The
    connection's own wait is given back after: the one it was taken with, what was left
    of its caller's deadline then (``_waited_for``), not a fresh ``BUSY_WAIT_MS``."""
    [(before,)] = db.execute("PRAGMA busy_timeout").fetchall()
    db.execute(f"PRAGMA busy_timeout={wait_ms}")
    try:
        # The row says whether it was busy: (busy, frames in the log, frames copied).
        [(busy, _, _)] = db.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
        return not busy
    finally:
        db.execute(f"PRAGMA busy_timeout={int(before)}")


def _start_log(db: sqlite3.Connection) -> None:
    """One small write, so that the log is (re)started here and not inside a commit on an
    event loop's thread: SQLite flushes a new log's header (and, a connection's first
    time, the folder) in the commit that writes its first frame, whatever ``synchronous``
    says. Called at open and after each checkpoint, which may have emptied the log."""
    with _Immediate(db):
        db.execute("INSERT OR REPLACE INTO log_starts VALUES (1, 1)")


# The two context managers of every write are classes, not generators: a webhook's
# inbox event and audit block each take a transaction, and a generator's manager costs
# some 70 interpreted instructions more (``bench/profile_gateway.py --instructions``).
class _Turn:
    """The store's connection for the block (``SmallObjects._db``), its lock released
    after; SQLite's errors inside it raised as the store's."""

    __slots__ = ("_lock", "_objects", "_wait")

    def __init__(self, objects: SmallObjects, wait: bool) -> None:
        self._objects, self._wait = objects, wait

    def __enter__(self) -> sqlite3.Connection:
        self._lock, db = self._objects._taken(self._wait)
        return db

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            if isinstance(exc, sqlite3.OperationalError):
                if not self._wait and _locked(exc):
                    raise Busy from exc
                raise StorageUnavailable(f"small objects at {self._objects.path}: {exc}") from exc
            if isinstance(exc, sqlite3.DatabaseError):  # a damaged file: not a bug here
                raise StorageUnavailable(f"small objects at {self._objects.path}: {exc}") from exc
        finally:
            self._lock.release()


class _Immediate:
    """A write transaction on ``db``: committed if the block ends, rolled back if it
    raises (a failed ``BEGIN`` or ``COMMIT`` included, so the connection is never left
    inside one)."""

    __slots__ = ("_db",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self._db.execute("COMMIT")
            except BaseException:
                self._roll_back()
                raise
            return
        self._roll_back()

    def _roll_back(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("ROLLBACK")


def _locked(exc: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused for a lock another connection holds (SQLITE_BUSY)."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


def _files_under(top: str) -> Iterator[str]:
    for folder, _, names in os.walk(top):
        for name in names:
            yield os.path.join(folder, name)


def _remove_empty(top: str) -> None:
    """The adopted folders removed, deepest first: no file of these prefixes is made again."""
    for folder, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
