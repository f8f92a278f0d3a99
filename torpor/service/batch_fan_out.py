"""A batch's fan-out (``torpor.service.batches``): its documents' sessions registered
under the running caps and created from the manifest a chunk at a time, a cursor saved
after each, in the background or in turn; those of retries cut short made; the sessions
of a cancelled batch ended."""

from __future__ import annotations

import asyncio
import logging

from pydantic import JsonValue

from torpor.batches import Attempts, BatchManifest, FanOutCursor
from torpor.errors import NotFound
from torpor.faults import CrashPoint, crash_point
from torpor.ports import TimerKind
from torpor.ports.services import Services
from torpor.ports.slots import batch_scope, tenant_scope
from torpor.service.batch_reads import SUBMITS_AT_ONCE, BatchReads

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


class BatchFanOut(BatchReads):
    """The sessions of a batch made (and those of a cancelled one ended)."""

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
