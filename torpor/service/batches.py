"""Batches: one session per document, accepted at once, fanned out behind the answer.

``accept`` writes the documents and then the manifest (create-only; the batch id is a
function of tenant and Idempotency-Key, so a retried request finds its batch) and answers;
``fan_out`` creates the sessions from the manifest, a chunk at a time, saving a cursor
after each. Each document's session id is a function of the manifest, and creating a
session is create-only, so a fan-out resumed after a crash (the reconciler finds the
batch by its ``FANOUT`` timer, set before the manifest) never makes a document's session
twice. Sessions are registered under the batch's and tenant's running caps before they
are created; their activation then waits for a slot (``torpor.service.admission``). A retry
sets the same timer before it records its generation: the fan-out also makes the sessions
of a retry killed before it made them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from datetime import timedelta

from pydantic import JsonValue

from torpor.batches import (
    RETRYABLE_STATES,
    Attempts,
    BatchManifest,
    BatchProgress,
    RetryGeneration,
    document_id,
    id_refusal,
)
from torpor.errors import (
    BatchCancelled,
    BatchExpired,
    IdempotencyMismatch,
    InvalidRequest,
    NotFound,
    PluginNotFound,
    UnknownAgent,
)
from torpor.faults import CrashPoint, crash_point
from torpor.ids import batch_session_id, checked_tenant, new_batch_id
from torpor.ports import TimerKind
from torpor.service.batch_export import BatchExport
from torpor.service.batch_fan_out import BatchFanOut, register_slots
from torpor.service.sessions import fingerprint
from torpor.ssrf import check_callback

# A batch's metadata, JSON-encoded, at most: it is copied into every document's session and
# rewritten with each of its commits, so unbounded, 1 MB of it beside 10,000 documents
# (a 1 MB request) made 10 GB of sessions.
METADATA_MAX_BYTES = 16 * 1024

# Imported from here by the rest of torpor, its tests and benches (the parts live in
# ``torpor.service.batch_*``; a test patching one of them patches the module that
# reads it).
__all__ = [
    "BatchService",
    "register_slots",
]


class BatchService(BatchExport, BatchFanOut):
    """Submit a batch of documents and follow, cancel, retry and export it."""

    # -- submit -----------------------------------------------------------------------

    async def submit(
        self,
        *,
        tenant: str,
        agent: str,
        documents: list[JsonValue],
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        batch_id: str | None = None,
        max_running: int | None = None,
    ) -> BatchManifest:
        """Accept the batch, then fan it out: in the background for a service that answers
        first (``background``), else before returning."""
        manifest = await self.accept(
            tenant=tenant,
            agent=agent,
            documents=documents,
            metadata=metadata,
            callback_url=callback_url,
            batch_id=batch_id,
            max_running=max_running,
        )
        if self.sessions.background:
            self.start_fan_out(manifest.batch_id)
        else:
            await self.fan_out(manifest.batch_id)
        return manifest

    def ensure_acceptable(
        self,
        agent: str,
        documents: Sequence[JsonValue],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """``InvalidRequest`` for no documents, document ids that are not unique strings or
        integers (``id_refusal``) or metadata past ``METADATA_MAX_BYTES``; ``UnknownAgent``
        unless ``agent`` is configured: checked before anything of the batch is stored."""
        if not documents:
            raise InvalidRequest("a batch needs at least one document")
        refusal = id_refusal(documents)
        if refusal is not None:
            raise InvalidRequest(refusal)
        if metadata and len(json.dumps(dict(metadata)).encode()) > METADATA_MAX_BYTES:
            raise InvalidRequest(
                f"metadata: at most {METADATA_MAX_BYTES} bytes as JSON (every document's "
                "session carries a copy)"
            )
        self._ensure_agent(agent)

    def _ensure_agent(self, agent: str) -> None:
        try:
            self.services.plugins.agent(agent)
        except PluginNotFound as exc:
            raise UnknownAgent(f"no agent named {agent!r} is configured") from exc

    async def accept(
        self,
        *,
        tenant: str,
        agent: str,
        documents: list[JsonValue],
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        batch_id: str | None = None,
        max_running: int | None = None,
    ) -> BatchManifest:
        """Durably accept a batch; creates no session. Idempotent by ``batch_id``."""
        metadata = dict(metadata or {})
        cap = min(
            max_running or self.settings.max_running_per_batch, self.settings.max_running_per_batch
        )
        fp = fingerprint(
            {
                "agent": agent,
                "documents": documents,
                "metadata": metadata,
                "callback": callback_url,
                "max_running": max_running,
            }
        )
        batch_id = batch_id or new_batch_id()
        existing = await self._existing(batch_id, tenant, fp)
        if existing is not None:
            return existing
        # The checks after the look for the batch, before anything is stored: a retry of
        # an accepted request finds its batch, whatever changed since (a limit tightened,
        # the callback host's resolution failing now).
        checked_tenant(tenant)
        self.ensure_acceptable(agent, documents, metadata)
        if callback_url is not None:  # checked once here, not once per document
            if self.services.settings.notifications.key is None:
                raise InvalidRequest("callback_url needs notifications set up (notify_key)")
            notifications = self.services.settings.notifications
            await check_callback(
                callback_url,
                allow_private=notifications.allow_private_callbacks,
                timeout_s=notifications.timeout_s,
            )
        now = self.services.clock.now()
        # Before the documents: an accept that dies before its manifest leaves documents
        # nothing else names; retention finds them through this note (and deletes them).
        await self.services.batches.mark_accepting(batch_id, now)
        key = await self.services.batches.put_documents(batch_id, fp, documents)
        # Their ids beside them, for the results export: it names each line by its
        # document's id, and read every document of the batch (up to 10,000, each as large
        # as its sender made it) for those alone. Before the manifest, as the documents.
        await self.services.batches.put_document_ids(
            batch_id, fp, [document_id(document) for document in documents]
        )
        crash_point(CrashPoint.BATCH_DOCUMENTS)
        manifest = BatchManifest(
            batch_id=batch_id,
            tenant=tenant,
            agent=agent,
            created_at=now,
            # Listed for readers of the manifest; derived, so a resumed fan-out agrees.
            session_ids=[
                batch_session_id(batch_id, int(now.timestamp() * 1000), i)
                for i in range(len(documents))
            ],
            total=len(documents),
            metadata=metadata,
            callback_url=callback_url,
            fingerprint=fp,
            documents_key=key,
            max_running=cap,
        )
        # The safety net before the manifest: a batch whose fan-out dies (this replica is
        # killed) is found by the reconciler through this timer and finished.
        await self.services.index.schedule(
            kind=TimerKind.FANOUT, member=batch_id, at=now + self._grace
        )
        # And the net's own net: the index may be lost, with this timer in it, while the
        # fan-out is unfinished; repair finds the batch again through this marker.
        await self.services.batches.mark_fanning_out(batch_id)
        if not await self.services.batches.create(manifest):
            await self.services.batches.mark_accepted(batch_id)  # a manifest names them
            found = await self._existing(batch_id, tenant, fp)
            if found is None:  # pragma: no cover - create-only said it exists
                raise NotFound(f"no batch {batch_id!r}")
            return found
        crash_point(CrashPoint.BATCH_MANIFEST)
        # A crash before this leaves the note beside a manifest: retention removes it.
        await self.services.batches.mark_accepted(batch_id)
        return manifest

    async def _existing(self, batch_id: str, tenant: str, fp: str) -> BatchManifest | None:
        try:
            manifest = await self.get(batch_id, tenant=tenant)
        except NotFound:
            return None
        if manifest.fingerprint and manifest.fingerprint != fp:
            raise IdempotencyMismatch(
                "this Idempotency-Key was already used with a different batch"
            )
        return manifest

    # -- change -----------------------------------------------------------------------

    async def cancel(self, batch_id: str, *, tenant: str | None = None) -> BatchProgress:
        """Cancel every session not ended yet, and stop the fan-out. Idempotent."""
        manifest = await self.get(batch_id, tenant=tenant)
        # The marker first: a fan-out running now stops at its next chunk, and one that
        # resumes later makes nothing more.
        await self.services.batches.mark_cancelled(batch_id)
        task = self._fan_outs.get(batch_id)
        if task is not None:
            # ``wait``, not ``gather``: a cancel cancelled while it waits (Serve cancels the
            # handler of a client that went away) must not take the fan-out with it, cut
            # off mid-chunk before its own look at the marker ends what it made.
            await asyncio.wait({task})
        attempts = await self.attempts(manifest)
        # Below the cursor only: the fan-out ends those it makes past it (``fan_out``).
        await self._cancel_sessions(attempts.all_current(await self.created(manifest)))
        return await self.progress(batch_id, tenant=tenant)

    async def retry(self, batch_id: str, *, tenant: str | None = None) -> list[int]:
        """New sessions for the documents whose session FAILED or TIMED_OUT; the document
        indexes retried. Idempotent: a retried document has a live session, so asking
        again retries nothing (until that one fails too)."""
        manifest = await self.get(batch_id, tenant=tenant)
        if await self.services.batches.is_cancelled(batch_id):
            raise BatchCancelled(f"batch {batch_id} is cancelled")
        if self._expired(manifest):
            # Its sessions may have gone (retention), and a retry would take a purged
            # one for a retry that died before making it, and make it again.
            retention = timedelta(seconds=self.services.settings.storage.retention_s)
            raise BatchExpired(
                f"batch {batch_id} is older than the retention period ({retention}): "
                "submit its failed documents as a new batch"
            )
        # Its agent removed since the accept, a retry's sessions would only fail again.
        self._ensure_agent(manifest.agent)
        generations = await self.services.batches.generations(batch_id)
        attempts = Attempts.of(manifest, generations)
        ids = attempts.all_current(await self.created(manifest))
        states = await self._states(ids)
        # Retries that died before they created their sessions: finish them first. Every
        # generation's, not the latest's alone: two cut short in a row (the second with
        # other documents failed) left the first one's documents unmade for ever.
        retried = {i for g in generations for i in g.documents}
        unfinished = [i for i in sorted(retried) if ids[i] not in states]
        failed = [i for i, sid in enumerate(ids) if states.get(sid) in RETRYABLE_STATES]
        if failed or unfinished:
            # The fan-out's safety net, before the generation: a retry killed before it
            # made its sessions is finished by the reconciler (``fan_out``). Left to fire:
            # the fan-out it starts finds nothing to make, and takes it away.
            await self.services.index.schedule(
                kind=TimerKind.FANOUT, member=batch_id, at=self.services.clock.now() + self._grace
            )
            await self.services.batches.mark_fanning_out(batch_id)
        if failed:
            generation = RetryGeneration(
                generation=len(generations) + 1,
                documents=failed,
                created_at=self.services.clock.now(),
            )
            if not await self.services.batches.add_generation(batch_id, generation):
                return []  # a concurrent retry made this generation: it creates them
            attempts = Attempts.of(manifest, [*generations, generation])
        todo = sorted(set(unfinished) | set(failed))
        if not todo:
            return []
        crash_point(CrashPoint.BATCH_RETRY)
        await self._make(manifest, attempts, todo)
        return failed
