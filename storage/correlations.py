"""Durable correlation records: correlation id → session, in the object store.

Written before the index is bound, kept after the wait closes. A flushed or lagging Redis
therefore never turns a valid callback away (the ingress falls back to the record), and a
late callback for a closed wait still finds its session, where it is recorded as an
observation and answered with the session's real outcome instead of a 404.
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from storage import keys
from torpor.errors import ObjectNotFound
from torpor.ports import ObjectStore, WaitBinding


class ObjectCorrelations:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def record(self, binding: WaitBinding, *, business_key: str | None) -> None:
        data = binding.model_dump_json().encode()
        # Single writer per correlation id (the session holding its lease), so a plain PUT
        # is safe; rewriting the same record after a crash is harmless. The session's ref
        # (naming both records, for retention) goes in the same round trip.
        await asyncio.gather(
            self.store.put(keys.correlation(binding.correlation_id), data),
            self.store.put(keys.correlation_ref(binding.session_id, binding.correlation_id), b""),
        )
        if business_key:
            await self.record_business_key(binding, business_key=business_key)

    async def record_business_key(self, binding: WaitBinding, *, business_key: str) -> None:
        # The session's ref names the pointer too, so retention can delete it (only while
        # it still names this correlation id).
        bk_key = keys.business_key(binding.tenant, business_key)
        await asyncio.gather(
            self.store.put(bk_key, binding.correlation_id.encode()),
            self.store.put(
                keys.correlation_ref(binding.session_id, binding.correlation_id),
                bk_key.encode(),
            ),
        )

    async def lookup(self, correlation_id: str) -> WaitBinding | None:
        try:
            obj = await self.store.get(keys.correlation(keys.safe(correlation_id)))
        except ObjectNotFound:
            return None
        try:
            return WaitBinding.model_validate_json(obj.data)
        except ValidationError:
            return None

    async def lookup_business_key(self, *, tenant: str, business_key: str) -> WaitBinding | None:
        correlation_id = await self.business_key_target(tenant=tenant, business_key=business_key)
        if correlation_id is None:
            return None
        binding = await self.lookup(correlation_id)
        return binding if binding is not None and binding.tenant == tenant else None

    async def business_key_target(self, *, tenant: str, business_key: str) -> str | None:
        try:
            obj = await self.store.get(keys.business_key(tenant, business_key))
        except ObjectNotFound:
            return None
        return obj.data.decode(errors="replace")
