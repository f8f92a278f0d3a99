"""What a look at a batch costs in store reads: a batch's GET, its results and its export
read each object they need once (memory store, its reads counted; ``test_batches`` has
what they answer)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from storage import keys
from tests.runtime.test_batches import World, finished, opened
from tests.support.harness import keys_read
from torpor.batches import RetryGeneration
from torpor.entry.batches import batch_out

RETRIES = 5


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with opened({"index_url": "memory://"}) as w:
        yield w


async def retried(world: World, docs: int) -> str:
    """A finished batch with ``RETRIES`` retry generations (of no document: what is read
    is counted here, not what a retry does)."""
    bid = (await finished(world, "fin", [{"id": f"d{i}"} for i in range(docs)])).batch_id
    now = world.services.clock.now()
    for g in range(1, RETRIES + 1):
        made = RetryGeneration(generation=g, documents=[], created_at=now)
        assert await world.services.batches.add_generation(bid, made)
    return bid


def retries_read(read: list[str], bid: str) -> list[str]:
    return sorted(k for k in read if k.startswith(keys.batch_retries(bid)))


async def test_a_get_of_a_batch_reads_its_manifest_and_each_retry_generation_once(
    world: World,
) -> None:
    """The GET's progress read the manifest and every retry generation, and its page of
    sessions read them all again: a batch retried 100 times cost 200 store reads a poll."""
    bid = await retried(world, 3)
    read = keys_read(world.services.store)
    out = await batch_out(world.batches, bid, "acme")
    assert out.finished and out.by_state == {"COMPLETED": 3} and len(out.session_ids) == 3
    assert retries_read(read, bid) == [keys.batch_retry(bid, g) for g in range(1, RETRIES + 1)]
    assert read.count(keys.batch(bid)) == 1


async def test_an_export_reads_each_retry_generation_once(world: World) -> None:
    """The results GET read every retry generation to count them, the export read them
    again, and its progress a third time: three reads of each, for an export's name and
    one view of each document's current session."""
    bid = await retried(world, 3)
    read = keys_read(world.services.store)
    rows = (await world.batches.results(bid, "jsonl")).splitlines()  # exported here
    assert len(rows) == 3
    assert retries_read(read, bid) == [keys.batch_retry(bid, g) for g in range(1, RETRIES + 1)]


async def test_the_results_of_an_exported_batch_read_no_retry_generation(world: World) -> None:
    """A download names the export by how many retries the batch had: it read each retry
    generation whole for that number, on every download. A listing counts them."""
    bid = await retried(world, 3)
    first = await world.batches.results(bid, "jsonl")
    read = keys_read(world.services.store)
    assert await world.batches.results(bid, "jsonl") == first
    assert retries_read(read, bid) == []
    assert keys.batch_export(bid, generation=RETRIES) in read


async def test_an_export_names_its_lines_by_their_documents_ids_without_reading_the_documents(
    world: World,
) -> None:
    """The export read the batch's documents, every one of them whole, for their ids
    alone: the ids are kept beside them at the accept, and read instead."""
    docs: list[Any] = [{"id": f"d{i}", "text": "x" * 10_000} for i in range(4)]
    manifest = await finished(world, "fin", docs)
    assert manifest.documents_key is not None
    read = keys_read(world.services.store)
    rows = [
        json.loads(x)
        for x in (await world.batches.results(manifest.batch_id, "jsonl")).splitlines()
    ]
    assert [r["document_id"] for r in rows] == ["d0", "d1", "d2", "d3"]
    assert manifest.documents_key not in read


async def test_a_batch_accepted_before_the_ids_were_kept_names_its_lines_by_its_documents(
    world: World,
) -> None:
    """Its export reads the documents for their ids, as every export did."""
    manifest = await finished(world, "fin", [{"id": 7}, {"doc": 1}, {"id": "x"}])
    ids = keys.batch_document_ids(manifest.batch_id, manifest.fingerprint)
    await world.services.store.delete(ids)  # as an accept before this one left it
    read = keys_read(world.services.store)
    rows = [
        json.loads(x)
        for x in (await world.batches.results(manifest.batch_id, "jsonl")).splitlines()
    ]
    assert [r["document_id"] for r in rows] == ["7", None, "x"]
    assert manifest.documents_key in read
