"""Refuse an object store that ignores conditional writes, before anything relies on them.

Create-only (``If-None-Match: *``) and compare-and-swap (``If-Match``) are how torpor keeps
one writer per session and one record per event. A store that silently ignores them (an
old MinIO, a proxy that strips the headers, a gateway that does not implement them)
turns both into blind overwrites and every guarantee with them. The probe writes a
scratch object three ways and checks that the store said no where it had to.
"""

from __future__ import annotations

import secrets

from storage import keys
from torpor.errors import ConditionalWritesIgnored, EtagMismatch, ObjectExists
from torpor.ports import ObjectStore


async def verify_conditional_writes(store: ObjectStore) -> None:
    """Raise ``ConditionalWritesIgnored`` (naming the store) unless it honours conditional
    writes."""
    key = keys.probe(secrets.token_hex(8))
    try:
        etag = await store.put_if_absent(key, b"probe-0")
        try:
            await store.put_if_absent(key, b"probe-1")
        except ObjectExists:
            pass
        else:
            raise ConditionalWritesIgnored(
                f"the object store at {store.url} ignores If-None-Match: create-only writes "
                "would overwrite; use a store that supports conditional writes"
            )
        stale = '"0123456789abcdef0123456789abcdef"'
        try:
            await store.put_if_match(key, b"probe-2", etag=stale if stale != etag else '"x"')
        except EtagMismatch:
            pass
        else:
            raise ConditionalWritesIgnored(
                f"the object store at {store.url} ignores If-Match: compare-and-swap would "
                "overwrite; use a store that supports conditional writes"
            )
        await store.put_if_match(key, b"probe-3", etag=etag)
    finally:
        await store.delete(key)
