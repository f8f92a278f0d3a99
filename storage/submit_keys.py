"""Submit Idempotency-Keys in the object store: one create-only record per key.

The index's claim answers a retry fast, but it lives only in the index: after an index
loss a retry of a submit that had already made its session would claim the key afresh
and make a second one. The record here outlives the index and names the session the
key made; a ref beside the session (``keys.submit_key_ref``) lets retention delete the
record with it.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timedelta

from storage import keys
from torpor.errors import EtagMismatch, ObjectExists, ObjectNotFound, StorageUnavailable
from torpor.ids import digest
from torpor.ports import ObjectStore, SubmitKey

ROUNDS = 8  # compare-and-swap rounds taking over an expired record before giving up


def encode(record: SubmitKey) -> bytes:
    return json.dumps(
        {
            "session_id": record.session_id,
            "fingerprint": record.fingerprint,
            "created_at": record.created_at.isoformat(),
        }
    ).encode()


def decode(data: bytes) -> SubmitKey:
    raw = json.loads(data)
    return SubmitKey(
        session_id=keys.safe(raw["session_id"], "session id"),
        fingerprint=str(raw["fingerprint"]),
        created_at=datetime.fromisoformat(raw["created_at"]),
    )


def key_digest(key: str) -> str:
    return digest(key)


class ObjectSubmitKeys:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def claim(self, *, tenant: str, key: str, record: SubmitKey, ttl: timedelta) -> SubmitKey:
        hashed = key_digest(key)
        name = keys.submit_key(tenant, hashed)
        data = encode(record)
        for _ in range(ROUNDS):
            try:
                await self.store.put_if_absent(name, data)
            except ObjectExists:
                pass
            else:
                await self._ref(tenant, hashed, record)
                return record
            try:
                current = await self.store.get(name)
            except ObjectNotFound:
                continue  # deleted since (retention): create it again
            stored = decode(current.data)
            if record.created_at - stored.created_at < ttl:
                # Found only when the index lost its claim or a request died: its ref
                # again, in case the request that wrote the record died before it.
                await self._ref(tenant, hashed, stored)
                return stored
            # Older than the key is kept: the key is free again, this request takes it.
            with contextlib.suppress(EtagMismatch):
                await self.store.put_if_match(name, data, etag=current.etag)
                await self._ref(tenant, hashed, record)
                return record
        raise StorageUnavailable(f"submit key record {name}: {ROUNDS} writes lost")

    async def _ref(self, tenant: str, hashed: str, record: SubmitKey) -> None:
        """After the record, so a request that loses the race leaves no ref naming a
        session it never makes; a crash between the two leaves the record without its
        ref until a retry of the key writes it (or, with none, for good: a few bytes)."""
        await self.store.put(keys.submit_key_ref(record.session_id, tenant, hashed), b"")
