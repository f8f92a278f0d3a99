"""The local object store's small objects, as rows (``storage.small_objects``): read,
created in one transaction per event loop's batch, replaced, and made durable by flushes
of one event loop made one at a time (``storage.local_store`` routes keys to them)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TypeVar

from storage import small_objects
from storage.keys import check_object_key
from storage.local_folder import LocalFolder, _RowCreate
from storage.local_fs import etag_of
from storage.local_io import INLINE_READ_BYTES, _raise_translated, _threads
from storage.loop_batches import forget_when_done
from torpor.errors import ObjectExists, ObjectNotFound, StorageUnavailable
from torpor.ports import Staged, StoredObject

log = logging.getLogger(__name__)
T = TypeVar("T")

_RowCreates = list[_RowCreate]
_RowsCreated = list[int | Exception]  # each one's commit ticket, or error
_Keys = list[str]


class LocalRows(LocalFolder):
    """The reads and writes of the objects held as rows."""

    # -- small objects, as rows (``storage.small_objects``) ------------------------------

    async def _rows_now(self, call: Callable[[bool], T]) -> T:
        """``call(wait)`` on the caller's thread (a few microseconds) unless another
        process holds the table's write lock: then in a worker thread, which waits."""
        try:
            return call(False)
        except small_objects.Busy:
            return await self._off_loop(call, True)

    async def _row(self, key: str, max_bytes: int | None) -> StoredObject:
        check_object_key(key)
        found = await self._rows_now(lambda wait: self._rows.get(key, wait=wait))
        if found is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key)
        data, etag = found
        return StoredObject(data if max_bytes is None else data[:max_bytes], etag)

    async def _row_keys(self, prefix: str, start_after: str | None, limit: int) -> _Keys:
        """One more than ``limit`` if there are more: ``_page`` and ``_merged`` tell so."""
        if not prefix.isascii():
            return []  # keys are ASCII (``keys.check_object_key``): none starts with it
        return await self._rows_now(
            lambda wait: self._rows.keys(prefix, start_after, limit + 1, wait=wait)
        )

    async def _row_created(self, key: str, data: bytes) -> tuple[str, int]:
        """A create made with the others asked for in this event loop (one transaction
        for all, ``_create_row_batch``): its etag and its commit's ticket."""
        check_object_key(key)
        etag = etag_of(data)
        return etag, await self._row_creates.call((key, data, etag), self._create_row_batch)

    async def _create_row_batch(self, items: _RowCreates) -> _RowsCreated:
        """Rows created in one transaction: its ticket for each row made, ``ObjectExists``
        for each whose key was taken. Should the transaction fail, every create fails."""
        create = functools.partial(_create_rows_in, self._rows, items)
        # A large block (an audit block under load) is copied off the loop.
        if sum(len(data) for _, data, _ in items) <= INLINE_READ_BYTES:
            made, ticket = await self._rows_now(create)
        else:
            made, ticket = await self._off_loop(create, True)
        return [
            ticket if won else ObjectExists(f"object {key!r} already exists", key=key)
            for (key, _, _), won in zip(items, made, strict=True)
        ]

    async def _row_replaced(
        self, key: str, data: bytes, *, expect: str | None, staged: bool = False
    ) -> Staged:
        check_object_key(key)
        etag = etag_of(data)

        def replace(wait: bool) -> int:
            return self._rows.replace(key, data, etag, expect=expect, wait=wait)

        # A large object (a long session's snapshot) is copied off the loop.
        if len(data) <= INLINE_READ_BYTES:
            ticket = await self._rows_now(replace)
        else:
            ticket = await self._off_loop(replace, True)
        if not staged:
            await self._rows_durable(ticket)
        return Staged(etag, functools.partial(self._rows_durable, ticket))

    async def _rows_durable(self, ticket: int) -> None:
        """Return once the rows' commit ``ticket`` is durable: flushes of one event loop
        go one at a time, each for everything committed before it; alone, with nothing
        else in flight and the disk quick (``_Inline``), on the caller's thread."""
        while self._rows.synced < ticket:
            loop = asyncio.get_running_loop()
            flush = self._row_syncs.get(loop)
            if flush is None or flush.done():
                if self._inline.allows(0):
                    try:
                        self._inline.run(functools.partial(self._rows.sync, ticket))
                    except OSError as exc:
                        _raise_translated(exc)
                    continue
                flush = asyncio.ensure_future(self._off_loop(self._rows.sync, self._rows.committed))
                self._row_syncs[loop] = flush
                # Not kept once done: a future holds its loop, which the weak key would
                # not free (a store outlives the loops that used it).
                flush.add_done_callback(functools.partial(forget_when_done, self._row_syncs))
            await asyncio.shield(flush)
        if self._rows.checkpoint_due():
            _threads().submit(_checkpoint, self._rows)


def _checkpoint(rows: small_objects.SmallObjects) -> None:
    try:
        rows.checkpoint()
    except (OSError, StorageUnavailable) as exc:  # the next one tries again; nothing lost
        log.warning("local object store: a checkpoint of the rows' log failed: %s", exc)


def _create_rows_in(
    rows: small_objects.SmallObjects, items: list[tuple[str, bytes, str]], wait: bool
) -> tuple[list[bool], int]:
    return rows.create(items, wait=wait)
