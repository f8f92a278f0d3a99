"""``file:///path``: the embedded object store, one folder on one host.

It gives the same create-only and compare-and-swap semantics as S3 to every process on
the host:

* ``put_if_absent`` writes a temporary file and moves it into place with
  ``renameat2(RENAME_NOREPLACE)`` (``_place_new``): it fails with EEXIST if the key
  exists, so exactly one creator wins (the key's lock is held
  only to log the change in order with the key's other changes). The
  creates waiting in one event loop are handed to a worker thread together
  (``_create_all``): one hop for all of them (0.08 ms of CPU per create, was 0.37).
* ``put_if_match``, ``delete`` and ``delete_if_match`` take an exclusive ``flock`` on a
  per-key lock file, compare the current etag and swap the new content in, or the object
  out (``_swap_in``: the old file is kept to be recycled, ``storage.blanks``): readers
  never see a half-written file, two writers never both pass the etag check, and a
  reader checks after its read that the key still names the file it read
  (``_unchanged``).

The objects every webhook creates (its inbox event, its replay marker) are not files:
they are rows of one SQLite table in ``.small`` (``storage.small_objects``), chosen by
key prefix, with the same semantics; a listing that spans both kinds merges them.

Etags are the MD5 of the content, as S3 computes them for single-part uploads.
Blocking file I/O runs in worker threads of the store's own so the caller's event loop
keeps serving; the exceptions are a whole read of a small object (``_read_small``) and
the listing of a small flat folder (``_list_small``), cheaper on the caller's thread
than the hop, and a write made while nothing else of the store's is in flight
(``_Inline``): one at a time, the hop to a worker thread and back wakes two sleeping
threads, which after an idle gap cost about as much as the flush itself (README, "Speed
(0.4)", fifth pass). A write waits for no lock on the caller's thread: a key another
process holds goes to a worker thread, and so do all writes while recent flushes were
slow or inline writes have had their share of the loop's time. A disk that stalls
without warning holds the loop for the first inline write caught in it.

Every durable change is logged (``storage.wal``): the object's file is written and its
bytes flushed (``_written``: a rename the disk keeps must never name bytes it lost; files
written together start their writeback together), it is renamed into place, the change
is appended to this process's write-ahead log under the key's lock, and one
``fdatasync`` of the log makes the rename durable, shared by every change logged
meanwhile; a change is acknowledged only after that flush, and the first store to open
the folder after a reboot replays what the file system may have lost. Removals are
logged (and so durable) too. An object larger than ``wal.RECORD_MAX_BYTES`` is flushed
in place instead. A create can be staged (``stage_if_absent``): in place and logged, its
flush awaited later, so that a webhook's inbox event and its audit record, whose verdict
depends on whether the event was new, share one flush. A create its writer marks as
not ``durable`` (the replay marker: ``storage.inbox`` says what a power cut that takes
it lets through) is neither flushed nor logged. (One ``syncfs`` per group of creates
was tried: it flushes everyone's dirty data on the file system, Ray's logs included,
and cost 1.6 ms of kernel CPU per webhook against 0.09 ms; the log's checkpoints call
it once per segment or per 30 s.)
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from storage import small_objects, wal
from storage.keys import check_object_key
from storage.local_creates import LocalCreates
from storage.local_files import READ_ATTEMPTS, LocalFiles
from storage.local_folder import CREATES_AT_ONCE, _release
from storage.local_fs import etag_of
from storage.local_io import (
    INLINE_BURST_S,
    INLINE_FLUSH_BUDGET_S,
    INLINE_READ_BYTES,
    INLINE_SHARE,
    WRITER_THREADS,
    _Inline,
)
from storage.local_listing import INLINE_LIST_ENTRIES, LocalListing, _merged, _page
from storage.local_locks import LOCK_STRIPES, _Contended
from storage.local_rows import LocalRows
from torpor.errors import ObjectNotFound
from torpor.ports import ListPage, Staged, StoredObject, already_durable

# Imported from here by the rest of torpor, its tests and benches (the parts live in
# ``storage.local_*``; a test patching one of them patches the module that reads it).
__all__ = [
    "CREATES_AT_ONCE",
    "INLINE_BURST_S",
    "INLINE_FLUSH_BUDGET_S",
    "INLINE_LIST_ENTRIES",
    "INLINE_READ_BYTES",
    "INLINE_SHARE",
    "LOCK_STRIPES",
    "READ_ATTEMPTS",
    "WRITER_THREADS",
    "LocalObjectStore",
    "_Contended",
    "_Inline",
    "_page",
    "etag_of",
]


class LocalObjectStore(LocalListing, LocalRows, LocalFiles, LocalCreates):
    """The ``ObjectStore`` of one local folder: each call routed by its key to the rows
    (``storage.local_rows``) or to the files (``storage.local_files``, ``local_creates``,
    ``local_listing``), over the state of ``storage.local_folder``."""

    def trouble(self) -> str | None:
        """``ReportsTrouble``: why the log no longer checkpoints, if it does not, and why
        the rows' log can no longer be made durable, if it cannot (every inbox event,
        replay marker and audit block is refused from then on: without this the store
        answered its health checks clean while every webhook of the process failed), in
        this process or, within ``wal.AGE_POLL_S``, another of the boot's."""
        found = []
        if (reason := self._log.not_checkpointing) is not None:
            found.append(f"write-ahead log not checkpointing: {reason}")
        if (failed := self._rows.failed_flush) is not None:
            found.append(
                f"small objects' log not durable, every row write refused: a flush failed"
                f" ({failed})"
            )
        return "; ".join(found) or None

    def figures(self) -> dict[str, int]:
        """What this process's checkpoints of the rows' log did
        (``small_objects.LogUpkeep``; ``bench/profile_gateway.py`` prints them). No I/O.
        Not on ``/healthz``: it is unauthenticated, and the counts follow the traffic."""
        return self._rows.figures()

    # -- async protocol -------------------------------------------------------------

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        if small_objects.holds(key):
            return await self._row(key, max_bytes)
        small = self._read_small(key)
        if small is not None:
            if max_bytes is not None:  # the etag names the whole object, as S3's does
                return StoredObject(small.data[:max_bytes], small.etag)
            return small
        return await self._off_loop(self._get, key, max_bytes)

    async def put(self, key: str, data: bytes) -> str:
        if small_objects.holds(key):
            return (await self._row_replaced(key, data, expect=None)).etag
        return await self._write(functools.partial(self._put, key, data), size=len(data))

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        """Queued with the other creates waiting in this event loop: one worker thread
        writes them all and makes each durable, then links each into place. A small
        object that need not be ``durable`` is created at once on the caller's thread
        (``_create_now``)."""
        if small_objects.holds(key):
            etag, ticket = await self._row_created(key, data)
            if durable:
                await self._rows_durable(ticket)
            return etag
        if not durable and len(data) <= INLINE_READ_BYTES:
            return self._create_now(key, data)
        etag, _ = await self._queued(key, data, staged=False)
        return etag

    async def stage_if_absent(self, key: str, data: bytes) -> Staged:
        """``put_if_absent`` that may return once the object is in place and logged,
        before the log's flush: ``durable()`` waits for a flush that covers it, usually
        that of a create the caller made meanwhile (a flush covers everything logged
        before it). Queued like any create: alone, it is placed (on the caller's thread
        when ``_Inline`` allows, else in a worker thread) and not flushed; with other
        creates waiting beside it, it is made durable with them, one hop and one flush
        for all, as under load. A small object (``storage.small_objects``) is committed,
        the same way."""
        if small_objects.holds(key):  # flushed by the caller's next durable write, as here
            etag, ticket = await self._row_created(key, data)
            return Staged(etag, functools.partial(self._rows_durable, ticket))
        etag, ticket = await self._queued(key, data, staged=True)
        return Staged(etag, functools.partial(self._durable, ticket) if ticket else already_durable)

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        if small_objects.holds(key):
            return (await self._row_replaced(key, data, expect=etag)).etag
        return await self._write(
            functools.partial(self._put_if_match, key, data, etag), size=len(data)
        )

    async def stage_if_match(self, key: str, data: bytes, *, etag: str) -> Staged:
        """``put_if_match`` that returns once the object is in place and logged, before
        the log's flush: ``durable()`` waits for a flush that covers it, usually that of
        a write the caller made meanwhile (a session's last commit: its marker's move)."""
        if small_objects.holds(key):
            return await self._row_replaced(key, data, expect=etag, staged=True)
        new_etag, ticket = await self._write(
            functools.partial(self._swap_if_match, key, data, etag), size=len(data)
        )
        return _Logged(
            new_etag, functools.partial(self._durable, ticket), self._log, ticket, os.getpid()
        )

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        files, rows = small_objects.reach(prefix)
        if not rows:
            return await self._list_files(prefix, start_after, limit)
        keys = await self._row_keys(prefix, start_after, limit)
        if not files:
            return _page(keys, prefix, start_after, limit)
        return _merged(await self._list_files(prefix, start_after, limit), keys, limit)

    async def walk(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        """``list`` for a walk of the whole prefix: a large folder is listed once for the
        walk, not once per page (``storage.cursors``)."""
        files, rows = small_objects.reach(prefix)
        if not rows:
            return await self._off_loop(self._walk, prefix, start_after, limit)
        keys = await self._row_keys(prefix, start_after, limit)
        if not files:
            return _page(keys, prefix, start_after, limit)
        walked = await self._off_loop(self._walk, prefix, start_after, limit)
        return _merged(walked, keys, limit)

    async def delete(self, key: str) -> None:
        if small_objects.holds(key):
            check_object_key(key)
            ticket = await self._rows_now(lambda wait: self._rows.remove(key, wait=wait))
            await self._rows_durable(ticket)
            return
        await self._write(functools.partial(self._delete, key), size=0)

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        if small_objects.holds(key):
            check_object_key(key)
            ticket = await self._rows_now(
                lambda wait: self._rows.remove_if_match(key, etag, wait=wait)
            )
            if ticket is None:
                return False
            await self._rows_durable(ticket)
            return True
        return await self._write(functools.partial(self._delete, key, etag=etag), size=0)

    async def move(self, key: str, to: str, *, after: Staged | None = None) -> bool:
        if small_objects.holds(key) or small_objects.holds(to):
            return await self._row_moved(key, to, after)
        ticket = 0
        if isinstance(after, _Logged) and after.log is self._log and after.pid == os.getpid():
            ticket = after.ticket  # ordered in the log: ``_move``
        elif after is not None:  # another store's write: durable before anything moves
            await after.durable()
        try:  # a large object is moved off the loop, as it is written
            size = os.stat(self._file(key)).st_size
        except OSError:
            size = 0  # missing: ``_move`` says so under the locks
        return await self._write(functools.partial(self._move, key, to, after=ticket), size=size)

    async def _row_moved(self, key: str, to: str, after: Staged | None) -> bool:
        """``move`` where either key is a row's: one transaction if both are (durable
        on return), else a put of ``to`` and then a delete of ``key`` (a crash between
        leaves it at both; the move done again completes it)."""
        if key == to:
            raise ValueError(f"a move needs two keys, not {key!r} twice")
        check_object_key(key)
        check_object_key(to)
        if after is not None:
            await after.durable()
        if small_objects.holds(key) and small_objects.holds(to):
            ticket = await self._rows_now(lambda wait: self._rows.rename(key, to, wait=wait))
            if ticket is None:
                return False
            await self._rows_durable(ticket)
            return True
        try:
            found = await self.get(key)
        except ObjectNotFound:
            return False
        await self.put(to, found.data)
        await self.delete(key)
        return True

    async def warm(self) -> None:
        """The lock files opened, the log's first segment put in place and the empty
        files and folders made ahead, now. A new process did all of it inside its first
        write, on metadata the kernel had not read yet (inode tables, block bitmaps):
        the first webhook a replica took answered in 12-20 ms, its blank makers and its
        handler queued on one folder's lock."""
        await self._off_loop(self._warm)

    def _warm(self) -> None:
        if not self._finalizer.alive:
            return  # closed: nothing it opened now would be closed again
        self._locks.open_all()
        self._log.ready()
        self._blanks.fill()
        self._blank_folders.fill()

    async def close(self) -> None:
        if self._finalizer.alive:
            self._finalizer()
        else:  # used again since it was closed: what that reopened is given back too
            _release(self._locks, self._log, self._blanks, self._blank_folders, rows=self._rows)


@dataclass(frozen=True, slots=True)
class _Logged(Staged):
    """A staged write of one store: the log, and its ticket, a flush must cover; in the
    process that made it (a forked child's log numbers its tickets anew)."""

    log: wal.WriteAheadLog
    ticket: int
    pid: int
