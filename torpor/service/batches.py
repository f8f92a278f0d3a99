"""Batches: one session per document, submitted together, followed as one.

Each document is submitted with the idempotency key ``batch:{id}:{n}`` and the manifest is
written create-only after every session exists, so re-submitting a batch after a crash
creates nothing twice and ends with the same manifest.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from pydantic import JsonValue

from torpor.batches import BatchManifest, BatchProgress
from torpor.errors import InvalidRequest, NotFound, SessionNotFound
from torpor.ids import new_batch_id
from torpor.service.sessions import SessionService


class BatchService:
    """Submit a batch of documents and follow its progress, through a ``SessionService``."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services

    async def submit(
        self,
        *,
        tenant: str,
        agent: str,
        documents: list[JsonValue],
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        batch_id: str | None = None,
        concurrency: int = 16,
    ) -> BatchManifest:
        """One session per document; the manifest of an earlier identical submission if
        there was one."""
        if not documents:
            raise InvalidRequest("a batch needs at least one document")
        batch_id = batch_id or new_batch_id()
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, doc: JsonValue) -> str:
            async with gate:
                result = await self.sessions.submit(
                    tenant=tenant,
                    agent=agent,
                    input=doc,
                    metadata=metadata,
                    callback_url=callback_url,
                    idempotency_key=f"batch:{batch_id}:{i}",
                    batch_id=batch_id,
                )
                return result.session_id

        ids = await asyncio.gather(*(one(i, d) for i, d in enumerate(documents)))
        manifest = BatchManifest(
            batch_id=batch_id,
            tenant=tenant,
            agent=agent,
            session_ids=list(ids),
            created_at=self.services.clock.now(),
        )
        if not await self.services.batches.create(manifest):
            return await self.get(batch_id, tenant=tenant)
        return manifest

    async def get(self, batch_id: str, *, tenant: str | None = None) -> BatchManifest:
        """A tenant never sees another tenant's batch: it is simply not found."""
        manifest = await self.services.batches.get(batch_id)
        if tenant is not None and manifest.tenant != tenant:
            raise NotFound(f"no batch {batch_id[:80]!r}")
        return manifest

    async def progress(self, batch_id: str, *, tenant: str | None = None) -> BatchProgress:
        manifest = await self.get(batch_id, tenant=tenant)
        states = await self.services.index.session_states(manifest.session_ids)
        missing = [sid for sid in manifest.session_ids if sid not in states]
        for sid in missing:  # the index lost them (e.g. flushed): ask the snapshots
            try:
                states[sid] = (await self.services.snapshots.header(sid)).state
            except SessionNotFound:
                continue
        counts = Counter(state.value for state in states.values())
        return BatchProgress(batch_id, len(manifest.session_ids), dict(counts))
