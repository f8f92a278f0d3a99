"""What is in the object store: a whole prefix, page by page, or whether one key is."""

from __future__ import annotations

from collections.abc import AsyncIterator

from torpor.errors import ObjectNotFound
from torpor.ports import ObjectStore


async def exists(store: ObjectStore, key: str) -> bool:
    """One byte read (a ranged GET on S3): the stores have no HEAD of their own."""
    try:
        await store.get(key, max_bytes=1)
    except ObjectNotFound:
        return False
    return True


async def each_key(store: ObjectStore, prefix: str) -> AsyncIterator[str]:
    """Every key under ``prefix``, in the store's order, one listing page at a time."""
    token: str | None = None
    while True:
        page = await store.list(prefix, start_after=token)
        for key in page.keys:
            yield key
        if page.next_token is None:
            return
        token = page.next_token


async def all_keys(store: ObjectStore, prefix: str) -> list[str]:
    """Every key under ``prefix``, in the store's order (all pages: callers that can stop
    early page themselves)."""
    return [key async for key in each_key(store, prefix)]
