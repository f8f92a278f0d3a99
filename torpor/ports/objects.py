"""The object store port: the source of truth (snapshots, inbox, correlation records,
audit log). Conditional writes are how torpor changes shared state in it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class StoredObject:
    data: bytes
    etag: str


@dataclass(frozen=True, slots=True)
class ListPage:
    keys: list[str]
    next_token: str | None  # pass as ``start_after`` to get the next page; None at the end


class ObjectStore(Protocol):
    """Keys are '/'-separated relative paths of safe characters (see ``storage.keys``).

    Conditional writes are the only way torpor changes shared state in the store:
    ``put_if_absent`` is create-only (``If-None-Match: *``), ``put_if_match`` is a
    compare-and-swap on the etag (``If-Match``). Each raises a ``PreconditionFailed``
    subclass when it loses, and writes nothing.
    """

    @property
    def url(self) -> str: ...

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        """Raise ``ObjectNotFound`` if absent. ``max_bytes`` reads only a prefix."""
        ...

    async def put(self, key: str, data: bytes) -> str:
        """Unconditional write (for objects with a single writer); returns the etag."""
        ...

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        """Create-only; raise ``ObjectExists`` if the key exists.

        ``durable=False`` is for an object whose loss to a power cut is harmless: a store
        that flushes every write to its disk (the local folder) may skip the flush. The
        object is still visible to every reader at once, created once, and outlives the
        crash of any process; stores whose every write is durable (S3) ignore it."""
        ...

    async def put_if_match(self, key: str, data: bytes, *, etag: str) -> str:
        """Replace only if the current etag is ``etag``; raise ``EtagMismatch`` otherwise
        (also when the object no longer exists)."""
        ...

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        """Keys under ``prefix`` in lexicographic order, one page at a time."""
        ...

    async def delete(self, key: str) -> None:
        """Idempotent: deleting a missing key is not an error."""
        ...

    async def close(self) -> None: ...
