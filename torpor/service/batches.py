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
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta

from pydantic import JsonValue

from torpor.batches import (
    RETRYABLE_STATES,
    SESSIONS_PAGE,
    Attempts,
    BatchManifest,
    BatchProgress,
    FanOutCursor,
    ResultLine,
    RetryGeneration,
    SessionsPage,
    document_id,
    eta_seconds,
    id_refusal,
    sessions_page,
)
from torpor.errors import (
    BatchCancelled,
    BatchExpired,
    BatchNotFinished,
    IdempotencyMismatch,
    InvalidRequest,
    NotFound,
    PluginNotFound,
    SessionNotFound,
    UnknownAgent,
)
from torpor.faults import CrashPoint, crash_point
from torpor.ids import batch_session_id, new_batch_id
from torpor.lifecycle import SessionState
from torpor.ports import SlotUsage, TimerKind
from torpor.ports.services import Services
from torpor.ports.slots import batch_scope, tenant_scope
from torpor.service.sessions import SessionService, fingerprint
from torpor.ssrf import check_callback

SUBMITS_AT_ONCE = 32  # session creations one fan-out has in flight
# Documents an export reads the sessions of, and writes the lines of, at a time: what it
# holds of the results, and what a reader of it holds (``BatchRepository.results``).
# Whole, a 10,000-document batch's results were held at once, each a session's result.
EXPORT_PAGE = 256
# A batch's metadata, JSON-encoded, at most: it is copied into every document's session and
# rewritten with each of its commits, so unbounded, 1 MB of it beside 10,000 documents
# (a 1 MB request) made 10 GB of sessions.
METADATA_MAX_BYTES = 16 * 1024
# A result line whose session retention deleted before the results were first exported.
PURGED = "the session ended and was deleted by retention (storage.retention_s) before export"
log = logging.getLogger(__name__)


async def register_slots(
    services: Services, manifest: BatchManifest, members: dict[str, int]
) -> None:
    """Put the batch's sessions ``members`` (session id -> document index) under its
    running caps: the batch's own and its tenant's (by the fan-out, a retry, and repair
    after the index, where the registrations live, was lost)."""
    slots = services.slots
    if slots is None:
        return
    settings = services.settings.batches
    await slots.register(
        members=members,
        scopes={
            batch_scope(manifest.batch_id): manifest.max_running or settings.max_running_per_batch,
            tenant_scope(manifest.tenant): settings.max_running_per_tenant,
        },
        queue=batch_scope(manifest.batch_id),
    )


class BatchService:
    """Submit a batch of documents and follow, cancel, retry and export it."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self.settings = sessions.services.settings.batches
        self._fan_outs: dict[str, asyncio.Task[int]] = {}

    @property
    def _grace(self) -> timedelta:
        return timedelta(seconds=self.services.settings.reconciler.wake_grace_s)

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

    # -- fan-out ----------------------------------------------------------------------

    def start_fan_out(self, batch_id: str) -> None:
        """Fan out in this event loop's background (once per batch and process)."""
        running = self._fan_outs.get(batch_id)
        if running is not None and not running.done():
            return
        task = asyncio.create_task(self.fan_out(batch_id))
        self._fan_outs[batch_id] = task
        task.add_done_callback(self._fanned_out)

    def _fanned_out(self, task: asyncio.Task[int]) -> None:
        for batch_id, t in list(self._fan_outs.items()):
            if t is task:
                del self._fan_outs[batch_id]
        if not task.cancelled() and task.exception() is not None:
            # The FANOUT timer is still set: the reconciler resumes from the cursor.
            log.error("batch fan-out failed; the reconciler resumes it", exc_info=task.exception())

    async def drain(self) -> None:
        """Wait for background fan-outs (tests, orderly shutdown)."""
        while self._fan_outs:
            await asyncio.gather(*list(self._fan_outs.values()), return_exceptions=True)

    async def fan_out(self, batch_id: str) -> int:
        """Create the batch's sessions from its cursor on, and those of retries cut short;
        the number created now."""
        batches = self.services.batches
        try:
            manifest = await batches.get(batch_id)
        except NotFound:  # the timer was set, the manifest never written: nothing to do
            await self._finished(batch_id)
            return 0
        made = 0
        if manifest.documents_key is not None:
            cursor = await batches.cursor(batch_id)
            if cursor.next < manifest.total:
                made += await self._fan_out_from(manifest, manifest.documents_key, cursor)
            # A retry sets this timer before it records its generation: one killed before
            # it made the generation's sessions is finished here (else by nothing but a
            # second retry, which no one may ever ask for).
            # Past the period no retry is taken, and a session gone then was purged, not
            # left unmade (``retry``): none is made again.
            if not self._expired(manifest) and not await batches.is_cancelled(batch_id):
                made += await self._finish_retries(manifest)
        await self._finished(batch_id)
        return made

    async def _fan_out_from(self, manifest: BatchManifest, key: str, cursor: FanOutCursor) -> int:
        batches, index, batch_id = self.services.batches, self.services.index, manifest.batch_id
        documents = await batches.documents(key)
        made = 0
        chunk = self.settings.fanout_chunk
        reached = cursor.next
        for start in range(cursor.next, manifest.total, chunk):
            if await batches.is_cancelled(batch_id):
                break
            end = min(start + chunk, manifest.total)
            # Keep the safety net ahead of this fan-out, so the reconciler does not start
            # a second one while this one makes progress.
            await index.schedule(
                kind=TimerKind.FANOUT,
                member=batch_id,
                at=self.services.clock.now() + self._grace,
            )
            # A resumed fan-out registers sessions of this chunk that may have ended since
            # it was first made; ``_create`` then asks for each one's activation again, and
            # an ended session's activation forgets its registration (``leave_slot``).
            await self._register(manifest, {manifest.session_id(i): i for i in range(start, end)})
            made += await self._create(
                manifest, [(i, manifest.session_id(i), documents[i]) for i in range(start, end)]
            )
            crash_point(CrashPoint.BATCH_FANOUT_CHUNK)
            await batches.save_cursor(batch_id, FanOutCursor(next=end))
            reached = end
        if await batches.is_cancelled(batch_id):
            # A cancel ends the sessions below the cursor it reads (after its marker). Those
            # made beyond it, by this fan-out after that read or by one killed before its
            # cursor write (up to a chunk past the cursor), only the fan-out can see: and a
            # fan-out that checks the marker after its cursor write misses none of them.
            await self._cancel_sessions(
                [
                    manifest.session_id(i)
                    for i in range(cursor.next, min(reached + chunk, manifest.total))
                ]
            )
        return made

    async def _finish_retries(self, manifest: BatchManifest) -> int:
        """Make the sessions of every retry generation that has not made them all."""
        generations = await self.services.batches.generations(manifest.batch_id)
        if not generations:
            return 0
        attempts = Attempts.of(manifest, generations)
        retried = sorted({i for g in generations for i in g.documents})
        states = await self._states([attempts.current(i) for i in retried])
        todo = [i for i in retried if attempts.current(i) not in states]
        if not todo:
            return 0
        return await self._make(manifest, attempts, todo)

    async def _finished(self, batch_id: str) -> None:
        """The fan-out is done (or cancelled, or has nothing to do): its marker first, so
        a crash between the two leaves the timer, which finds nothing to do again."""
        await self.services.batches.mark_fanned_out(batch_id)
        await self.services.index.unschedule(kind=TimerKind.FANOUT, member=batch_id)

    async def _register(self, manifest: BatchManifest, members: dict[str, int]) -> None:
        await register_slots(self.services, manifest, members)

    async def _create(
        self, manifest: BatchManifest, items: list[tuple[int, str, JsonValue]]
    ) -> int:
        gate = asyncio.Semaphore(SUBMITS_AT_ONCE)

        async def one(session_id: str, document: JsonValue) -> bool:
            async with gate:
                submitted = await self.sessions.submit(
                    tenant=manifest.tenant,
                    agent=manifest.agent,
                    input=document,
                    metadata=manifest.metadata,
                    callback_url=manifest.callback_url,
                    batch_id=manifest.batch_id,
                    session_id=session_id,
                    agent_checked=True,  # at the accept (``ensure_acceptable``)
                )
                return submitted.created

        created = await asyncio.gather(*(one(sid, doc) for _, sid, doc in items))
        return sum(created)

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

    async def _cancel_sessions(self, ids: list[str]) -> None:
        """Cancel those of ``ids`` that exist and have not ended."""
        states = await self._states(ids)
        gate = asyncio.Semaphore(SUBMITS_AT_ONCE)

        async def one(session_id: str) -> None:
            async with gate:
                await self.sessions.cancel(session_id)

        await asyncio.gather(
            *(one(sid) for sid in ids if sid in states and not states[sid].terminal)
        )

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

    async def _make(self, manifest: BatchManifest, attempts: Attempts, todo: list[int]) -> int:
        """Make the current sessions of the documents ``todo`` (a retry's); those made."""
        documents = await self._documents(manifest)
        await self._register(manifest, {attempts.current(i): i for i in todo})
        made = await self._create(manifest, [(i, attempts.current(i), documents[i]) for i in todo])
        if await self.services.batches.is_cancelled(manifest.batch_id):
            # A cancel that came after the look above, before these were made, found none
            # of them to cancel: they ran on in a cancelled batch. (One that comes after
            # this look reads this generation, recorded first, and cancels them itself.)
            await self._cancel_sessions([attempts.current(i) for i in todo])
        return made

    async def _documents(self, manifest: BatchManifest) -> list[JsonValue]:
        if manifest.documents_key is None:
            raise InvalidRequest("this batch was made before documents were kept")
        return await self.services.batches.documents(manifest.documents_key)

    async def _document_ids(self, manifest: BatchManifest) -> list[str | None]:
        """Each document's id (``document_id``), in order; none for a batch made before
        documents were kept."""
        if not manifest.documents_key:
            return []
        batches = self.services.batches
        ids = await batches.document_ids(manifest.batch_id, manifest.fingerprint)
        if ids is None:  # accepted before the ids were kept beside the documents
            ids = [document_id(document) for document in await self._documents(manifest)]
        return ids

    # -- export -----------------------------------------------------------------------

    async def result_stream(
        self, batch_id: str, fmt: str, *, tenant: str | None = None
    ) -> AsyncIterator[bytes]:
        """The batch's results in ``fmt`` (jsonl, parquet), exported once it finished, to
        be read a page at a time. The checks (``NotFound``, ``BatchNotFinished``) and the
        export are done before this returns: a stream answers nothing but its bytes."""
        await self.get(batch_id, tenant=tenant)
        # Exports are kept per retry generation: a retry's sessions change the results,
        # and an export written before it must not be answered after it. Counted, not
        # read: every download of a batch retried 100 times read 100 objects for a number.
        generation = await self.services.batches.generation_count(batch_id)
        found = await self.services.batches.results(batch_id, fmt, generation=generation)
        if found is None:
            generation = await self.export(batch_id, tenant=tenant)
            found = await self.services.batches.results(batch_id, fmt, generation=generation)
        if found is None:  # export just wrote it: ``fmt`` is no format of it
            raise NotFound(f"no {fmt[:20]!r} results for batch {batch_id}")
        return found

    async def results(self, batch_id: str, fmt: str, *, tenant: str | None = None) -> bytes:
        """The whole export, for a caller that wants it whole (the Python client): the
        HTTP edge streams ``result_stream``."""
        stream = await self.result_stream(batch_id, fmt, tenant=tenant)
        return b"".join([chunk async for chunk in stream])

    async def export(self, batch_id: str, *, tenant: str | None = None) -> int:
        """Write the results of a finished batch (one line per document) to the store, a
        page of ``EXPORT_PAGE`` documents at a time; the retry generations it is the
        export of."""
        # Read once, before anything: the lines and the export's name agree on them even if
        # a retry comes meanwhile (its sessions, not made yet, would read as cancelled).
        # Its progress counts the sessions of these very generations (not read again).
        generations = await self.services.batches.generations(batch_id)
        manifest = await self.get(batch_id, tenant=tenant)
        attempts = Attempts.of(manifest, generations)
        progress = await self.progress_of(manifest, attempts=attempts)
        if not progress.finished:
            raise BatchNotFinished(
                f"batch {batch_id}: {progress.done} of {progress.total} documents done"
            )
        ids = await self._document_ids(manifest)
        created, expired = await self.created(manifest), self._expired(manifest)
        gate = asyncio.Semaphore(SUBMITS_AT_ONCE)

        async def line(i: int) -> ResultLine:
            session_id = attempts.current(i)
            doc_id = ids[i] if i < len(ids) else None
            async with gate:
                try:
                    snap = await self.sessions.get(session_id)
                except SessionNotFound:
                    if expired and i < created:  # ended and deleted (``progress``)
                        return ResultLine(
                            index=i,
                            document_id=doc_id,
                            session_id=session_id,
                            state=None,
                            error=PURGED,
                        )
                    return ResultLine(  # never made: the batch was cancelled first
                        index=i,
                        document_id=doc_id,
                        session_id=session_id,
                        state=SessionState.CANCELLED,
                    )
            return ResultLine(
                index=i,
                document_id=doc_id,
                session_id=session_id,
                state=snap.state,
                result=snap.result,
                error=snap.error.message if snap.error else None,
            )

        generation = len(generations)
        pages = range(0, manifest.size, EXPORT_PAGE)
        for page, start in enumerate(pages):
            end = min(start + EXPORT_PAGE, manifest.size)
            lines = await asyncio.gather(*(line(i) for i in range(start, end)))
            # Progress counts a cancelled batch's documents past its cursor as cancelled,
            # while sessions a fan-out made there may still be ending (``fan_out``): an
            # export is kept, so it is sealed only once every line has its final state
            # (pages written before this one are written again by the next export).
            running = sum(1 for x in lines if x.state is not None and not x.state.terminal)
            if running:
                raise BatchNotFinished(f"batch {batch_id}: {running} sessions not ended yet")
            await self.services.batches.put_results_page(
                batch_id, page, list(lines), generation=generation
            )
            crash_point(f"{CrashPoint.BATCH_EXPORT_PAGE}.{page}")
        await self.services.batches.seal_results(batch_id, generation=generation, pages=len(pages))
        return generation
