"""A batch's results export (``torpor.service.batches``): one line per document, written
a page at a time once the batch finished, kept per retry generation, and read back as
a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from torpor.batches import Attempts, BatchManifest, ResultLine, document_id
from torpor.errors import BatchNotFinished, NotFound, SessionNotFound
from torpor.faults import CrashPoint, crash_point
from torpor.lifecycle import SessionState
from torpor.service.batch_reads import SUBMITS_AT_ONCE, BatchReads

# Documents an export reads the sessions of, and writes the lines of, at a time: what it
# holds of the results, and what a reader of it holds (``BatchRepository.results``).
# Whole, a 10,000-document batch's results were held at once, each a session's result.
EXPORT_PAGE = 256
# A result line whose session retention deleted before the results were first exported.
PURGED = "the session ended and was deleted by retention (storage.retention_s) before export"


class BatchExport(BatchReads):
    """The results of a finished batch, exported and read."""

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
