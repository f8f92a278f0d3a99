"""Listing a whole prefix of the object store, page by page."""

from __future__ import annotations

from torpor.ports import ObjectStore


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
