"""Retention's state and its reads of the store (``storage.retention``): where each
of its round robins stopped, and an object read, parsed, listed or deleted as the sweeps
all do."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from datetime import datetime
from typing import TypeVar

from pydantic import ValidationError

from storage import keys
from storage.listing import all_keys
from storage.snapshots import ObjectSnapshots
from torpor.batches import BatchManifest, FanOutCursor, RetryGeneration
from torpor.deliveries import Delivery
from torpor.errors import (
    ObjectNotFound,
)
from torpor.events import InboxEvent
from torpor.ports import ObjectStore, StoredObject, WaitBinding

DELETES_AT_ONCE = 16
T = TypeVar("T", InboxEvent, Delivery, BatchManifest, WaitBinding, FanOutCursor, RetryGeneration)


class RetentionState:
    """What the parts of ``ObjectRetention`` share: the store, the snapshots, the cursors."""

    def __init__(self, store: ObjectStore, snapshots: ObjectSnapshots | None = None) -> None:
        self.store = store
        self.snapshots = snapshots or ObjectSnapshots(store)
        # Where the last sweep stopped: sessions kept back do not starve the ones after.
        self._cursor: str | None = None
        self._audit_cursor: str | None = None
        self._batch_cursor: str | None = None
        self._accept_cursor: str | None = None
        self._replay_cursor: str | None = None  # the one-time pass over the markers
        self._replays_indexed = False  # that pass was made (``keys.REPLAYS_LISTED``)
        self._submit_cursor: str | None = None
        self._submit_pass_after: datetime | None = None  # the next pass, not before
        # How many of each batch's sessions (in the order they are looked at) are known
        # gone: the next visit starts there, at the one found still stored last time.
        self._batch_gone: OrderedDict[str, int] = OrderedDict()

    async def _delete(self, doomed: list[str]) -> None:
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str) -> None:
            async with gate:
                await self.store.delete(key)

        await asyncio.gather(*(one(k) for k in doomed))

    async def _list(self, prefix: str) -> list[str]:
        return await all_keys(self.store, prefix)

    async def _data(self, key: str) -> bytes | None:
        found = await self._stored(key)
        return None if found is None else found.data

    async def _stored(self, key: str) -> StoredObject | None:
        try:
            return await self.store.get(keys.check_object_key(key))
        except ObjectNotFound:
            return None

    async def _stored_time(self, key: str) -> datetime | None:
        """The time ``key`` holds (ISO 8601), None if it is gone; ValueError if it holds
        none (the accept notes and the ended markers of purged sessions are stamped)."""
        data = await self._data(key)
        return None if data is None else datetime.fromisoformat(data.decode())

    async def _read(self, key: str, model: type[T]) -> T | None:
        data = await self._data(key)
        return None if data is None else _parsed(data, model)


def _parsed(data: bytes, model: type[T]) -> T | None:
    try:
        return model.model_validate_json(data)
    except ValidationError:
        return None
