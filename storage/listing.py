"""What is in the object store: a whole prefix, page by page, or whether one key is."""

from __future__ import annotations

from torpor.errors import ObjectNotFound
from torpor.ports import ObjectStore


async def exists(store: ObjectStore, key: str) -> bool:
    """One byte read (a ranged GET on S3): the stores have no HEAD of their own."""
    try:
        await store.get(key, max_bytes=1)
    except ObjectNotFound:
        return False
    return True


async def all_keys(store: ObjectStore, prefix: str) -> list[str]:
    """Every key under ``prefix``, in the store's order (all pages: callers that can stop
    early page themselves)."""
    found: list[str] = []
    token: str | None = None
    while True:
        page = await store.list(prefix, start_after=token)
        found += page.keys
        if page.next_token is None:
            return found
        token = page.next_token
