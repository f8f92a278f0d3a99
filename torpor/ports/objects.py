"""The object store port: the source of truth (snapshots, inbox, correlation records,
audit log). Conditional writes are how torpor changes shared state in it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class StoredObject:
    data: bytes
    etag: str


@dataclass(frozen=True, slots=True)
class ListPage:
    keys: list[str]
    next_token: str | None  # pass as ``start_after`` to get the next page; None at the end


@dataclass(frozen=True, slots=True)
class Staged:
    """A create or a replace that won and is visible to every reader, not yet known to be
    durable: ``await durable()`` before acknowledging anything that rests on it."""

    etag: str
    durable: Callable[[], Awaitable[None]]


async def already_durable() -> None:
    """``Staged.durable`` of a store whose every write is durable when it returns."""


class ObjectStore(Protocol):
    """Keys are '/'-separated relative paths of safe characters (see ``storage.keys``).

    Conditional writes are the only way torpor changes shared state in the store:
    ``put_if_absent`` is create-only (``If-None-Match: *``), ``put_if_match`` is a
    compare-and-swap on the etag (``If-Match``). Each raises a ``PreconditionFailed``
    subclass when it loses, and writes nothing. ``delete_if_match`` is the delete's
    compare-and-swap: it answers False when it loses, and deletes nothing.
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

    async def delete_if_match(self, key: str, *, etag: str) -> bool:
        """Delete only if the current etag is ``etag`` (``If-Match`` on the delete), for
        an object another writer may replace meanwhile: True if this call deleted it;
        False, and nothing deleted, if it changed or is gone. (On S3, a request that
        botocore sent again after its first try deleted and lost the answer finds it
        gone: False, though the object went.)"""
        ...

    async def warm(self) -> None:
        """Do now what the first write would otherwise do inside its request (the local
        folder: its log put in place, its empty files made ahead). Changes no object; a
        store with nothing to prepare returns at once."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class MovesObjects(Protocol):
    """A store that can move an object to another key in one step: a reader finds it at
    one key or the other, never at neither. A crash before the move is acknowledged may
    leave it at both; the move done again then completes. Stores without it are used
    through a put of the new key, then a delete of the old (``ObjectSnapshots.
    mark_ended``: an ended session's marker)."""

    async def move(self, key: str, to: str, *, after: Staged | None = None) -> bool:
        """The object at ``key`` put at ``to`` (replacing what was there) and gone from
        ``key``, durable on return; False, and nothing changed, if ``key`` holds none.
        ``after``, a write this store staged before: the object leaves ``key`` only if
        that write is durable too (a session's live marker outlives no terminal
        snapshot a power cut could take back); the move may make it so, one flush for
        both. ``after.durable()`` is still the caller's to await."""
        ...


@runtime_checkable
class WalksObjects(Protocol):
    """A store with a cheaper way to walk a whole prefix than page after page of
    ``list``: the local folder lists a large folder once per walk, not once per page
    (``storage.cursors``). Stores without it are walked through ``list``."""

    async def walk(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        """``list``, for a caller that pages through the whole prefix from its start,
        passing each page's token back: a key created during the walk may be left out
        (as one created behind its position always is), one removed is not listed after."""
        ...


@runtime_checkable
class StagesReplaces(Protocol):
    """A store that can split a compare-and-swap in two, as ``StagesCreates`` splits a
    create: the object replaced (the swap won) and, later, made durable. A session's
    last commit then waits for one flush of its disk for its snapshot and its marker's
    move, where the two in a row waited for two (``ObjectSnapshots.save``). Stores
    without it are used through ``put_if_match``."""

    async def stage_if_match(self, key: str, data: bytes, *, etag: str) -> Staged:
        """Replace-if-match, as ``put_if_match`` (``EtagMismatch`` if it loses), but it
        may return before the new object is durable: a later write of this store (this
        instance) made durable covers it, and ``Staged.durable`` waits for one that does
        (raising if a flush that covered it failed)."""
        ...


@runtime_checkable
class StagesCreates(Protocol):
    """A store that can split a create in two: the object placed (whether this caller
    won is known) and, later, made durable. A caller that writes more after learning
    the outcome (the audit record of an inbox event) then waits for one flush of its
    disk for both, where two creates in a row waited for two. Stores without it are
    used through ``put_if_absent`` (``stage_if_absent`` in ``storage.inbox``)."""

    async def stage_if_absent(self, key: str, data: bytes) -> Staged:
        """Create-only, as ``put_if_absent`` (``ObjectExists`` if the key exists), but
        it may return before the object is durable."""
        ...


@runtime_checkable
class ReportsTrouble(Protocol):
    """A store that can be reachable and still be in trouble the operator must hear of:
    the local folder whose log no longer checkpoints (a flush of its disk failed; its
    logs grow until a reboot). Stores without it have nothing to report beyond whether
    they answer."""

    def trouble(self) -> str | None:
        """What is wrong, or None (no I/O: read by every health check)."""
        ...


def trouble_of(store: object) -> str | None:
    """What ``store`` reports is wrong (``ReportsTrouble``); None from a store that
    reports nothing beyond whether it answers."""
    return store.trouble() if isinstance(store, ReportsTrouble) else None
