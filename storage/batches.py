"""Batch manifests in the object store: one create-only object per batch."""

from __future__ import annotations

from pydantic import ValidationError

from storage import keys
from torpor.batches import BatchManifest
from torpor.errors import InvalidKey, NotFound, ObjectExists, ObjectNotFound
from torpor.ports import ObjectStore


class ObjectBatches:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def create(self, manifest: BatchManifest) -> bool:
        try:
            await self.store.put_if_absent(
                keys.batch(manifest.batch_id), manifest.model_dump_json().encode()
            )
        except ObjectExists:
            return False
        return True

    async def get(self, batch_id: str) -> BatchManifest:
        try:
            obj = await self.store.get(keys.batch(batch_id))
            return BatchManifest.model_validate_json(obj.data)
        except (ObjectNotFound, ValidationError, InvalidKey):
            raise NotFound(f"no batch {batch_id[:80]!r}") from None
