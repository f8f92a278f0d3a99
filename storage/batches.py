"""Batches in the object store: a create-only manifest per batch, and beside it the
documents, the fan-out cursor, the cancel marker, retry generations and the exports.

An export is stored as pages of JSONL lines and a record, written last, of how many there
are; it is read back a page at a time, encoded as it goes (``storage.results``). Written
whole, a 10,000-document batch's export was held in memory at once by its writer and by
every reader (and Parquet twice: built, then read back)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import datetime

from pydantic import BaseModel, ConfigDict, JsonValue, TypeAdapter, ValidationError

from storage import keys
from storage.listing import each_key, exists
from storage.results import ENCODERS, PageEncoder, jsonl
from torpor.batches import BatchManifest, FanOutCursor, ResultLine, RetryGeneration
from torpor.errors import (
    EtagMismatch,
    InvalidKey,
    NotFound,
    ObjectExists,
    ObjectNotFound,
    StorageUnavailable,
)
from torpor.ports import ObjectStore

_DOCUMENTS: TypeAdapter[list[JsonValue]] = TypeAdapter(list[JsonValue])
_DOCUMENT: TypeAdapter[JsonValue] = TypeAdapter(JsonValue)
_IDS: TypeAdapter[list[str | None]] = TypeAdapter(list[str | None])


CURSOR_ROUNDS = 20  # compare-and-swap rounds before a cursor write gives up
# Retry generations read at once: every look at a batch reads them all (its progress, its
# sessions, its export), and one read after the other made a batch retried 100 times wait
# for 100 store round trips in a row (seconds on S3) on every GET.
GENERATION_READS_AT_ONCE = 16


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

    async def mark_accepting(self, batch_id: str, at: datetime) -> None:
        # Unconditional: a retried request (same batch id) starts the clock again, so a
        # purge does not take its documents for an old attempt's.
        await self.store.put(keys.batch_accepting(batch_id), at.isoformat().encode())

    async def mark_accepted(self, batch_id: str) -> None:
        await self.store.delete(keys.batch_accepting(batch_id))

    async def put_documents(
        self, batch_id: str, fingerprint: str, documents: list[JsonValue]
    ) -> str:
        # Create-only: the key carries the request's fingerprint, so an existing object
        # holds these very documents (an earlier try of the same request).
        key = keys.batch_documents(batch_id, fingerprint)
        with contextlib.suppress(ObjectExists):
            await self.store.put_if_absent(key, json.dumps(documents).encode())
        return key

    async def documents(self, key: str) -> list[JsonValue]:
        return _DOCUMENTS.validate_json((await self.store.get(key)).data)

    async def put_document_ids(
        self, batch_id: str, fingerprint: str, ids: list[str | None]
    ) -> None:
        # Create-only, as the documents they are the ids of (``put_documents``).
        key = keys.batch_document_ids(batch_id, fingerprint)
        with contextlib.suppress(ObjectExists):
            await self.store.put_if_absent(key, json.dumps(ids).encode())

    async def document_ids(self, batch_id: str, fingerprint: str) -> list[str | None] | None:
        if not fingerprint:  # a manifest from before requests had one: no ids object
            return None
        try:
            obj = await self.store.get(keys.batch_document_ids(batch_id, fingerprint))
        except ObjectNotFound:
            return None
        return _IDS.validate_json(obj.data)

    async def put_document(self, batch_id: str, index: int, document: JsonValue) -> str:
        key = keys.batch_document(batch_id, index)
        await self.store.put(key, json.dumps(document).encode())
        return key

    async def document(self, key: str) -> JsonValue:
        if not key.startswith(keys.BATCH_DATA):  # a reference reads batch documents only
            raise NotFound("not a document reference")
        try:
            data = (await self.store.get(key)).data
        except (ObjectNotFound, InvalidKey):
            raise NotFound("no document at that reference") from None
        return _DOCUMENT.validate_json(data)

    async def cursor(self, batch_id: str) -> FanOutCursor:
        try:
            obj = await self.store.get(keys.batch_cursor(batch_id))
        except ObjectNotFound:
            return FanOutCursor()
        return FanOutCursor.model_validate_json(obj.data)

    async def save_cursor(self, batch_id: str, cursor: FanOutCursor) -> None:
        """Move the cursor forward, never back. Two fan-outs of one batch (a replica and
        the reconciler after its grace) write the same sessions; the one behind must not
        put the cursor back over what the other finished: were it then to die, with the
        other's end having taken the fan-out timer away, the cursor would stay short of
        the total for ever (the batch never counted as fanned out, never retained)."""
        key = keys.batch_cursor(batch_id)
        data = cursor.model_dump_json().encode()
        for _ in range(CURSOR_ROUNDS):
            try:
                current = await self.store.get(key)
            except ObjectNotFound:
                with contextlib.suppress(ObjectExists):  # the other one wrote first: look
                    await self.store.put_if_absent(key, data)
                    return
                continue
            if FanOutCursor.model_validate_json(current.data).next >= cursor.next:
                return
            with contextlib.suppress(EtagMismatch):
                await self.store.put_if_match(key, data, etag=current.etag)
                return
        # Only writers racing without end get here: the fan-out is retried by its timer.
        raise StorageUnavailable(f"fan-out cursor of {batch_id}: {CURSOR_ROUNDS} writes lost")

    async def mark_fanning_out(self, batch_id: str) -> None:
        with contextlib.suppress(ObjectExists):
            await self.store.put_if_absent(keys.fanout(batch_id), b"")

    async def mark_fanned_out(self, batch_id: str) -> None:
        await self.store.delete(keys.fanout(batch_id))

    async def fanning_out(self) -> AsyncIterator[str]:
        async for key in each_key(self.store, keys.FANOUTS):
            yield key.removeprefix(keys.FANOUTS)

    async def mark_cancelled(self, batch_id: str) -> None:
        with contextlib.suppress(ObjectExists):
            await self.store.put_if_absent(keys.batch_cancelled(batch_id), b"{}")

    async def is_cancelled(self, batch_id: str) -> bool:
        return await exists(self.store, keys.batch_cancelled(batch_id))

    async def add_generation(self, batch_id: str, generation: RetryGeneration) -> bool:
        try:
            await self.store.put_if_absent(
                keys.batch_retry(batch_id, generation.generation),
                generation.model_dump_json().encode(),
            )
        except ObjectExists:
            return False
        return True

    async def generations(self, batch_id: str) -> list[RetryGeneration]:
        """The batch's retry generations, in order: each listing page's read side by side
        (``GENERATION_READS_AT_ONCE`` at most)."""
        prefix = keys.batch_retries(batch_id)
        gate = asyncio.Semaphore(GENERATION_READS_AT_ONCE)

        async def one(key: str) -> RetryGeneration:
            async with gate:
                obj = await self.store.get(key)
            return RetryGeneration.model_validate_json(obj.data)

        out: list[RetryGeneration] = []
        start: str | None = None
        while True:
            page = await self.store.list(prefix, start_after=start)
            out.extend(await asyncio.gather(*(one(key) for key in page.keys)))
            if page.next_token is None:
                return out
            start = page.next_token

    async def generation_count(self, batch_id: str) -> int:
        """How many retry generations the batch has: their keys listed, none of them read
        (generations are numbered from 1 without a gap: each is made create-only as the
        one after those there are)."""
        count = 0
        async for _ in each_key(self.store, keys.batch_retries(batch_id)):
            count += 1
        return count

    async def put_results_page(
        self, batch_id: str, page: int, lines: list[ResultLine], *, generation: int
    ) -> None:
        # Unconditional: an export that died half-way, or one running beside this one,
        # wrote (or writes) the same lines, from the same ended sessions.
        key = keys.batch_export_page(batch_id, page, generation=generation)
        await self.store.put(key, jsonl(lines))

    async def seal_results(self, batch_id: str, *, generation: int, pages: int) -> None:
        sealed = ExportRecord(pages=pages).model_dump_json().encode()
        await self.store.put(keys.batch_export(batch_id, generation=generation), sealed)

    async def results(
        self, batch_id: str, fmt: str, *, generation: int = 0
    ) -> AsyncIterator[bytes] | None:
        encoder = ENCODERS.get(fmt)
        if encoder is None:
            return None
        try:
            record = await self.store.get(keys.batch_export(batch_id, generation=generation))
        except ObjectNotFound:
            return await self._whole(batch_id, fmt, generation)
        pages = ExportRecord.model_validate_json(record.data).pages
        return self._pages(batch_id, encoder(), pages=pages, generation=generation)

    async def _pages(
        self, batch_id: str, encoder: PageEncoder, *, pages: int, generation: int
    ) -> AsyncIterator[bytes]:
        for page in range(pages):
            key = keys.batch_export_page(batch_id, page, generation=generation)
            encoded = encoder.page((await self.store.get(key)).data)
            if encoded:
                yield encoded
        end = encoder.end()
        if end:
            yield end

    async def _whole(self, batch_id: str, fmt: str, generation: int) -> AsyncIterator[bytes] | None:
        """An export written whole, before exports were paged: its batch's sessions may
        have gone since (retention), so it is answered as it is, not made again."""
        try:
            key = keys.batch_results(batch_id, fmt, generation=generation)
            data = (await self.store.get(key)).data
        except ObjectNotFound:
            return None
        return _chunks(data)


class ExportRecord(BaseModel):
    """A whole export: its pages of lines, all written (``keys.batch_export``)."""

    model_config = ConfigDict(extra="forbid")

    pages: int


WHOLE_CHUNK = 64 * 1024  # an export written whole is answered in pieces of this size


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), WHOLE_CHUNK):
        yield data[start : start + WHOLE_CHUNK]
