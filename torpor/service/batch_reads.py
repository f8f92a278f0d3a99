"""A batch as it stands (``torpor.service.batches``): its manifest (a tenant sees only its
own), its retry generations, its documents, its sessions' states (the index, else the
snapshots), its progress, and its running caps' usage."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta

from pydantic import JsonValue

from torpor.batches import (
    SESSIONS_PAGE,
    Attempts,
    BatchManifest,
    BatchProgress,
    SessionsPage,
    eta_seconds,
    sessions_page,
)
from torpor.errors import InvalidRequest, NotFound, SessionNotFound
from torpor.lifecycle import SessionState
from torpor.ports import SlotUsage
from torpor.ports.slots import batch_scope, tenant_scope
from torpor.service.sessions import SessionService

SUBMITS_AT_ONCE = 32  # session creations one fan-out has in flight


class BatchReads:
    """What every part of the batch service shares, and the reads of a batch."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self.settings = sessions.services.settings.batches
        self._fan_outs: dict[str, asyncio.Task[int]] = {}

    @property
    def _grace(self) -> timedelta:
        return timedelta(seconds=self.services.settings.reconciler.wake_grace_s)

    # -- inspect ----------------------------------------------------------------------

    async def get(self, batch_id: str, *, tenant: str | None = None) -> BatchManifest:
        """A tenant never sees another tenant's batch: it is simply not found."""
        manifest = await self.services.batches.get(batch_id)
        if tenant is not None and manifest.tenant != tenant:
            raise NotFound(f"no batch {batch_id[:80]!r}")
        return manifest

    async def attempts(self, manifest: BatchManifest) -> Attempts:
        return Attempts.of(manifest, await self.services.batches.generations(manifest.batch_id))

    async def session_page(
        self,
        batch_id: str,
        *,
        tenant: str | None = None,
        cursor: str | None = None,
        limit: int = SESSIONS_PAGE,
    ) -> SessionsPage:
        """A page of the documents' current sessions (their latest retry's), in document
        order; ``InvalidRequest`` for a bad cursor or limit (``sessions_page``)."""
        manifest = await self.get(batch_id, tenant=tenant)
        return sessions_page(await self.attempts(manifest), cursor=cursor, limit=limit)

    async def created(self, manifest: BatchManifest) -> int:
        """How many documents have their (first) session."""
        if not manifest.documents_key:
            return manifest.size
        return (await self.services.batches.cursor(manifest.batch_id)).next

    async def _states(self, session_ids: list[str]) -> dict[str, SessionState]:
        states = await self.services.index.session_states(session_ids)
        gate = asyncio.Semaphore(SUBMITS_AT_ONCE)

        async def header(sid: str) -> None:
            # The index lost it (flushed), its chunk is being created, or retention deleted
            # it: the snapshot. Side by side: a lost index, or a batch past the period,
            # leaves up to every one of 10,000 to read, on every look at the batch.
            async with gate:
                try:
                    states[sid] = (await self.services.snapshots.header(sid)).state
                except SessionNotFound:
                    return

        await asyncio.gather(*(header(s) for s in session_ids if s not in states))
        return states

    async def progress(self, batch_id: str, *, tenant: str | None = None) -> BatchProgress:
        return await self.progress_of(await self.get(batch_id, tenant=tenant))

    async def progress_of(
        self, manifest: BatchManifest, *, attempts: Attempts | None = None
    ) -> BatchProgress:
        """The progress of the batch ``manifest``; ``attempts``: its retry generations as
        the caller read them. A GET of a batch shows its sessions too: reading them here
        again read every generation twice per poll (100 retries, 200 store reads)."""
        batch_id = manifest.batch_id
        created = await self.created(manifest)
        cancelled = await self.services.batches.is_cancelled(batch_id)
        if attempts is None:
            attempts = await self.attempts(manifest)
        made = attempts.all_current(created)
        states = await self._states(made)
        counts = Counter(state.value for state in states.values())
        # Past the period, a made document's session that is gone has ended and been
        # deleted (retention takes a batch's sessions one by one, ended ones only): done,
        # not back to PENDING (a finished batch read unfinished, its results refused).
        purged = len(made) - len(states) if self._expired(manifest) else 0
        # Sessions a fan-out made past the cursor (one killed before its cursor write, or
        # one running now: up to a chunk) count as what they are. Counted as unmade, a
        # cancelled batch read finished, all CANCELLED, while those ran on until the
        # resumed fan-out ended them. The index only: a cheap look, read on every GET.
        ahead = self._ahead(manifest, created)
        counts.update(s.value for s in (await self.services.index.session_states(ahead)).values())
        # Documents whose session is not there yet wait as PENDING (as CANCELLED once the
        # batch is: its fan-out stops and never makes them).
        unmade = manifest.size - sum(counts.values()) - purged
        if unmade:
            counts[(SessionState.CANCELLED if cancelled else SessionState.PENDING).value] += unmade
        done = sum(n for s, n in counts.items() if SessionState(s).terminal) + purged
        elapsed = (self.services.clock.now() - manifest.created_at).total_seconds()
        return BatchProgress(
            batch_id,
            manifest.size,
            dict(counts),
            created=created,
            cancelled=cancelled,
            eta_s=eta_seconds(total=manifest.size, done=done, elapsed_s=elapsed),
            purged=purged,
        )

    def _ahead(self, manifest: BatchManifest, created: int) -> list[str]:
        """The first sessions of the chunk past the cursor ``created``: those a fan-out
        may have made without having saved its cursor yet."""
        if not manifest.documents_key:
            return []
        end = min(created + self.settings.fanout_chunk, manifest.size)
        return [manifest.session_id(i) for i in range(created, end)]

    def _expired(self, manifest: BatchManifest) -> bool:
        """Whether the batch is older than the retention period: its sessions may have
        gone, and it takes no retry."""
        retention = timedelta(seconds=self.services.settings.storage.retention_s)
        return self.services.clock.now() - manifest.created_at >= retention

    async def usage(self, manifest: BatchManifest) -> tuple[SlotUsage, SlotUsage] | None:
        """Running and waiting sessions of the batch and of its tenant's batches."""
        slots = self.services.slots
        if slots is None:
            return None
        scope = batch_scope(manifest.batch_id)
        return (
            await slots.usage(scope=scope, queue=scope),
            await slots.usage(scope=tenant_scope(manifest.tenant), queue=scope),
        )

    async def _documents(self, manifest: BatchManifest) -> list[JsonValue]:
        if manifest.documents_key is None:
            raise InvalidRequest("this batch was made before documents were kept")
        return await self.services.batches.documents(manifest.documents_key)
