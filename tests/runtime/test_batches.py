"""Batches at document-set scale: accepted before any session exists, admitted under a cap
on RUNNING sessions, cancelled, retried and exported (memory adapters: no service is the
point here; the crash-resume of the fan-out is in tests/faults, HTTP in tests/ingress)."""

from __future__ import annotations

import asyncio
import io
import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, cast

import pyarrow.parquet as pq
import pytest
from pydantic import JsonValue

from actors.wiring import open_services, session_runtime
from storage import keys
from storage.listing import all_keys
from storage.retention import ObjectRetention
from tests.conftest import eventually
from tests.faults.index_loss import flush_index
from tests.runtime import memory_env
from tests.runtime.memory_env import plan_agent, reset
from tests.support.harness import keys_read
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.batches import SESSIONS_PAGE, SESSIONS_PAGE_MAX, BatchManifest, RetryGeneration
from torpor.clock import ManualClock
from torpor.entry.batches import batch_out
from torpor.errors import (
    BatchExpired,
    BatchNotFinished,
    InvalidRequest,
    PluginNotFound,
    SessionNotFound,
    UnknownAgent,
)
from torpor.lifecycle import SessionState
from torpor.models import Message
from torpor.ports import RetentionReport, TimerKind
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.batches import BatchService
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

S = SessionState
CAP = 2
DOCS = 6
DAY = timedelta(days=1)
BLOCK_PLAN = {
    "steps": [
        {"id": "b", "calls": [{"tool": "block", "args": {"hold_s": 10.0}}]},
        {"id": "done", "finish": "${results.b}"},
    ]
}
AGENTS = {
    "blk": plan_agent(BLOCK_PLAN, {"tests.runtime.memory_env:block": {}}),
    "fin": {"factory": "tests.runtime.memory_env:SlowAgent"},
    "flaky": {"factory": "tests.runtime.test_batches:FlakyAgent"},
}
FLAKY = {"on": True}


class FlakyAgent:
    """Crashes on documents marked ``fail`` while ``FLAKY["on"]``: the session FAILS."""

    name = "flaky"
    version = "1"

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if FLAKY["on"] and '"fail"' in (messages[-1].content or ""):
            raise ValueError("this document breaks the agent")
        return AgentTurn(Message(role="assistant", content="done"), result="done")


class World:
    def __init__(self, services: Services, runtime_background: bool) -> None:
        self.services = services
        runtime = session_runtime(services, "test-runtime")
        self.activator = InlineActivator(runtime, background=runtime_background)
        self.control = SessionService(services, self.activator)
        self.batches = BatchService(self.control)
        self.sweeper = Sweeper(self.control)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with opened({"index_url": "memory://"}) as w:
        yield w


@asynccontextmanager
async def opened(index: dict[str, str]) -> AsyncIterator[World]:
    """A world on the memory store, its index as ``index`` says (``storage`` settings)."""
    settings = Settings.build(
        {
            "storage": {"object_store_url": "memory://", **index},
            "agents": AGENTS,
            "lease": {"heartbeat_s": 0.02, "ttl_s": 30.0},
            "batches": {"max_running_per_batch": CAP, "fanout_chunk": 4},
        }
    )
    services = open_services(settings, clock=ManualClock())
    w = World(services, runtime_background=True)
    try:
        yield w
    finally:
        reset()
        await w.activator.drain()
        await services.close()


async def states(w: World, batch_id: str) -> Counter[str]:
    manifest = await w.batches.get(batch_id)
    found = await w.services.index.session_states(manifest.sessions())
    return Counter(s.value for s in found.values())


async def test_accept_writes_the_manifest_and_creates_no_session(world: World) -> None:
    docs: list[Any] = [{"doc": i} for i in range(DOCS)]
    manifest = await world.batches.accept(tenant="acme", agent="fin", documents=docs)
    assert manifest.total == DOCS and len(manifest.sessions()) == DOCS
    for sid in manifest.sessions():
        with pytest.raises(SessionNotFound):
            await world.services.snapshots.load(sid)
    # The reconciler would find it: its fan-out timer is set, due after the grace.
    later = world.services.clock.now().replace(year=2100)
    due = await world.services.index.due(kind=TimerKind.FANOUT, now=later, limit=10)
    assert due == [manifest.batch_id]
    progress = await world.batches.progress(manifest.batch_id)
    assert progress.by_state == {"PENDING": DOCS} and progress.created == 0
    # The same request again is the same batch; the fan-out then makes every session once.
    again = await world.batches.accept(
        tenant="acme", agent="fin", documents=docs, batch_id=manifest.batch_id
    )
    assert again == manifest
    assert await world.batches.fan_out(manifest.batch_id) == DOCS
    assert await world.batches.fan_out(manifest.batch_id) == 0
    assert await world.services.index.due(kind=TimerKind.FANOUT, now=later, limit=10) == []


async def test_never_more_than_the_cap_run_and_the_rest_wait_as_pending(world: World) -> None:
    probe = memory_env.PROBE
    manifest = await world.batches.submit(
        tenant="acme", agent="blk", documents=[{"doc": i} for i in range(DOCS)]
    )
    await eventually(lambda: probe.running == CAP, timeout_s=10, what="cap sessions block")
    assert await states(world, manifest.batch_id) == {"RUNNING": CAP, "PENDING": DOCS - CAP}
    usage = await world.batches.usage(manifest)
    assert usage is not None and (usage[0].running, usage[0].waiting) == (CAP, DOCS - CAP)
    probe.release.set()
    most = 0

    async def all_done() -> bool:
        nonlocal most
        now = await states(world, manifest.batch_id)
        most = max(most, now["RUNNING"])
        await world.sweeper.sweep_once()  # the queue's heads have retry timers due now
        return now == {"COMPLETED": DOCS}

    await eventually(all_done, timeout_s=15, what="every document completes")
    assert most <= CAP and probe.max_running == CAP
    assert len(probe.calls) == DOCS  # each document's tool ran once


@pytest.fixture
async def redis_world(redis_url: str, redis_prefix: str) -> AsyncIterator[World]:
    """As ``world``, with the index (and the running slots in it) in a real Redis."""
    async with opened({"index_url": redis_url, "redis_prefix": redis_prefix}) as w:
        yield w


@pytest.mark.redis
async def test_the_cap_holds_after_the_index_is_lost_and_repaired(
    redis_world: World, redis_url: str, redis_prefix: str
) -> None:
    """The slot registrations live in the index: without them, repair's activation of
    the batch's PENDING sessions found them uncapped and ran every one at once."""
    world, probe = redis_world, memory_env.PROBE
    manifest = await world.batches.submit(
        tenant="acme", agent="blk", documents=[{"doc": i} for i in range(DOCS)]
    )
    await eventually(lambda: probe.running == CAP, timeout_s=10, what="cap sessions block")
    await flush_index(redis_url, redis_prefix)
    report = await world.sweeper.sweep_once()  # not intact: repair
    assert report.repaired_sessions == DOCS and report.errors == []

    async def queued_again() -> bool:
        usage = await world.batches.usage(manifest)
        return usage is not None and (usage[0].running, usage[0].waiting) == (CAP, DOCS - CAP)

    await eventually(queued_again, timeout_s=10, what="the rest wait for a slot again")
    assert probe.running == CAP
    probe.release.set()

    async def all_done() -> bool:
        await world.sweeper.sweep_once()
        return await states(world, manifest.batch_id) == {"COMPLETED": DOCS}

    await eventually(all_done, timeout_s=15, what="every document completes")
    assert probe.max_running == CAP


async def test_cancel_ends_every_session_and_is_idempotent(world: World) -> None:
    probe = memory_env.PROBE
    manifest = await world.batches.submit(
        tenant="acme", agent="blk", documents=[{"doc": i} for i in range(DOCS)]
    )
    await eventually(lambda: probe.running == CAP, timeout_s=10, what="cap sessions block")
    await world.batches.cancel(manifest.batch_id)
    probe.release.set()

    async def cancelled() -> bool:
        await world.control.drain()
        return await states(world, manifest.batch_id) == {"CANCELLED": DOCS}

    await eventually(cancelled, timeout_s=15, what="every session cancelled")
    progress = await world.batches.cancel(manifest.batch_id)
    assert progress.cancelled and progress.by_state == {"CANCELLED": DOCS} and progress.finished
    assert len(probe.calls) == CAP  # the waiting ones never ran


async def test_progress_counts_by_state_with_an_eta(world: World) -> None:
    manifest = await world.batches.submit(
        tenant="acme", agent="fin", documents=[{"doc": i} for i in range(3)]
    )

    async def done() -> bool:
        await world.sweeper.sweep_once()  # past the cap: the queue's head is retried
        return (await world.batches.progress(manifest.batch_id)).finished

    await eventually(done, timeout_s=10, what="batch finishes")
    world.services.clock.advance(10)  # type: ignore[attr-defined]
    progress = await world.batches.progress(manifest.batch_id)
    assert progress.by_state == {"COMPLETED": 3} and progress.eta_s == 0.0


async def test_results_export_jsonl_and_parquet_once_finished(world: World) -> None:
    docs: list[Any] = [{"id": f"d{i}", "doc": i} for i in range(3)]
    manifest = await world.batches.accept(tenant="acme", agent="fin", documents=docs)
    with pytest.raises(BatchNotFinished):
        await world.batches.results(manifest.batch_id, "jsonl")
    await world.batches.fan_out(manifest.batch_id)

    async def done() -> bool:
        await world.sweeper.sweep_once()  # past the cap: the queue's head is retried
        return (await world.batches.progress(manifest.batch_id)).finished

    await eventually(done, timeout_s=10, what="batch finishes")
    lines = (await world.batches.results(manifest.batch_id, "jsonl")).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [(r["index"], r["document_id"], r["state"], r["result"]) for r in rows] == [
        (i, f"d{i}", "COMPLETED", "done") for i in range(3)
    ]
    data = await world.batches.results(manifest.batch_id, "parquet")
    table = pq.read_table(io.BytesIO(data))
    assert table.column("document_id").to_pylist() == ["d0", "d1", "d2"]
    assert [json.loads(v) for v in table.column("result").to_pylist()] == ["done"] * 3


async def test_a_batch_whose_agent_was_removed_after_its_accept_ends_failed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent was configured at the accept and removed before the fan-out: every
    submit of the fan-out raised UnknownAgent, on every reconciler pass, and the batch
    stayed PENDING for ever (never finished, never retained). Its documents end FAILED,
    as a session whose agent went does, and a retry is refused while the agent is gone."""
    docs: list[Any] = [{"id": f"d{i}", "doc": i} for i in range(3)]
    manifest = await world.batches.accept(tenant="acme", agent="fin", documents=docs)
    bid = manifest.batch_id
    resolve = world.services.plugins.agent

    def removed(name: str) -> Any:
        if name == "fin":
            raise PluginNotFound(f"no agent named {name!r} is configured")
        return resolve(name)

    monkeypatch.setattr(world.services.plugins, "agent", removed)
    assert await world.batches.fan_out(bid) == 3
    later = world.services.clock.now().replace(year=2100)
    assert await world.services.index.due(kind=TimerKind.FANOUT, now=later, limit=10) == []

    async def done() -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(bid)).finished

    await eventually(done, timeout_s=10, what="the batch finishes")
    assert (await world.batches.progress(bid)).by_state == {"FAILED": 3}
    rows = [json.loads(x) for x in await _lines(world, bid)]
    assert [(r["document_id"], r["state"]) for r in rows] == [(f"d{i}", "FAILED") for i in range(3)]
    assert all("'fin' is not configured" in r["error"] for r in rows)
    with pytest.raises(UnknownAgent):
        await world.batches.retry(bid)


async def test_results_name_a_document_id_accepted_before_ids_were_checked_in_json(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch accepted before ids had to be strings or integers may hold any JSON id:
    its results wrote Python's ``str()`` of it (``"True"``, ``"{'a': 1}"``), which no
    reader of JSON results can match to the id it sent."""
    # As before the check (``raising=False``: the code before it has no such name).
    monkeypatch.setattr("torpor.service.batches.id_refusal", lambda _: None, raising=False)
    docs: list[Any] = [{"id": True}, {"id": {"a": 1}}, {"id": 7}, {"id": "d"}, {"doc": 4}]
    manifest = await finished(world, "fin", docs)
    rows = [json.loads(x) for x in await _lines(world, manifest.batch_id)]
    assert [r["document_id"] for r in rows] == ["true", '{"a": 1}', "7", "d", None]


async def test_retry_makes_new_sessions_for_failed_documents_once(world: World) -> None:
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}, {"doc": 2, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(manifest.batch_id)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 2}), timeout_s=10, what="fail")
    FLAKY["on"] = False
    try:
        assert await world.batches.retry(manifest.batch_id) == [1, 2]
        assert await world.batches.retry(manifest.batch_id) == []  # nothing failed now
        await eventually(lambda: settled({"COMPLETED": 3}), timeout_s=10, what="retried")
    finally:
        FLAKY["on"] = True
    rows = [json.loads(x) for x in await _lines(world, manifest.batch_id)]
    assert [r["session_id"] for r in rows] == [
        manifest.session_id(0),
        manifest.session_id(1, attempt=1),
        manifest.session_id(2, attempt=1),
    ]
    assert [r["state"] for r in rows] == ["COMPLETED"] * 3
    # The first attempts stay as they were: FAILED, with their error.
    first = await world.services.snapshots.load(manifest.session_id(1))
    assert first.state is S.FAILED and first.error is not None


async def test_documents_of_every_retry_cut_short_are_made_by_the_next_one(
    world: World,
) -> None:
    """A retry records its generation, then makes its sessions. Killed in between twice
    (each time with other documents failed), the next retry finished only the latest
    generation: the earlier one's documents were never made, and the batch never ended."""
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}, {"doc": 2, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)
    bid = manifest.batch_id

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(bid)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 2}), timeout_s=10, what="fail")
    now = world.services.clock.now()
    for generation, document in ((1, 1), (2, 2)):  # two retries, each killed right there
        cut = RetryGeneration(generation=generation, documents=[document], created_at=now)
        assert await world.services.batches.add_generation(bid, cut)
    FLAKY["on"] = False
    try:
        assert await world.batches.retry(bid) == []  # nothing newly failed: it finishes
        await eventually(lambda: settled({"COMPLETED": 3}), timeout_s=10, what="both made")
    finally:
        FLAKY["on"] = True


async def test_a_cancel_that_lands_while_a_retry_makes_its_sessions_ends_them(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry looked for the cancel marker only before it started; a cancel that came
    after that look, before the retry made its sessions, found none of them to cancel,
    and they ran on in a batch that said CANCELLED."""
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)
    bid = manifest.batch_id

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(bid)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 1}), timeout_s=10, what="fail")
    create = world.batches._create

    async def cancelled_first(*args: Any, **kwargs: Any) -> None:
        await world.batches.cancel(bid)  # the operator's cancel, just before the creates
        await create(*args, **kwargs)

    monkeypatch.setattr(world.batches, "_create", cancelled_first)
    FLAKY["on"] = False  # left alone, the retried document would now complete
    try:
        assert await world.batches.retry(bid) == [1]

        retried, seen = manifest.session_id(1, attempt=1), []

        async def ended() -> bool:
            await world.sweeper.sweep_once()
            seen.append((await world.services.snapshots.load(retried)).state)
            return seen[-1].terminal

        await eventually(ended, timeout_s=10, what="the retried session ended")
        assert seen[-1] is S.CANCELLED, f"it ran on: {seen[-1]}"
    finally:
        FLAKY["on"] = True


async def test_results_exported_before_a_retry_are_exported_again_after_it(
    world: World,
) -> None:
    """The export is written once and kept: one read before a retry had every later read
    answer the first attempts' FAILED lines, whatever the retried sessions did."""
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(manifest.batch_id)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 1}), timeout_s=10, what="fail")
    before = [json.loads(x)["state"] for x in await _lines(world, manifest.batch_id)]
    assert before == ["COMPLETED", "FAILED"]
    FLAKY["on"] = False
    try:
        assert await world.batches.retry(manifest.batch_id) == [1]
        await eventually(lambda: settled({"COMPLETED": 2}), timeout_s=10, what="retried")
    finally:
        FLAKY["on"] = True
    rows = [json.loads(x) for x in await _lines(world, manifest.batch_id)]
    assert [(r["session_id"], r["state"]) for r in rows] == [
        (manifest.session_id(0), "COMPLETED"),
        (manifest.session_id(1, attempt=1), "COMPLETED"),
    ]
    data = await world.batches.results(manifest.batch_id, "parquet")
    table = pq.read_table(io.BytesIO(data))
    assert table.column("state").to_pylist() == ["COMPLETED", "COMPLETED"]


async def test_a_results_export_is_written_and_read_a_page_of_documents_at_a_time(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export of a 10,000-document batch was built whole in the request (every line,
    each a session's result, in memory at once), stored as one object per format, and
    read back whole before its first byte was sent. It is stored a page of lines an
    object, and streamed a page at a time: a reader holds one page of it, not the batch."""
    monkeypatch.setattr("torpor.service.batch_export.EXPORT_PAGE", 2)
    docs: list[Any] = [{"id": f"d{i}", "doc": i} for i in range(5)]
    bid = (await finished(world, "fin", docs)).batch_id
    jsonl = await world.batches.result_stream(bid, "jsonl")  # the export is written here
    pages = [keys.batch_export_page(bid, p, generation=0) for p in range(3)]
    stored = [(await world.services.store.get(k)).data.splitlines() for k in pages]
    assert [len(lines) for lines in stored] == [2, 2, 1]
    read = keys_read(world.services.store)
    first = await anext(jsonl)
    assert read == pages[:1], "one page read, then sent"
    rest = [chunk async for chunk in jsonl]
    assert read == pages
    rows = [json.loads(x) for x in b"".join([first, *rest]).splitlines()]
    assert [(r["index"], r["document_id"], r["state"]) for r in rows] == [
        (i, f"d{i}", "COMPLETED") for i in range(5)
    ]
    parquet = await world.batches.result_stream(bid, "parquet")
    read.clear()
    chunks = [await anext(parquet)]
    assert read == pages[:1], "a row group a page, each sent once encoded"
    chunks.extend([chunk async for chunk in parquet])
    exported = pq.ParquetFile(io.BytesIO(b"".join(chunks)))
    assert exported.num_row_groups == 3
    assert exported.read().column("document_id").to_pylist() == [f"d{i}" for i in range(5)]


async def test_an_export_written_whole_before_exports_were_paged_is_still_answered(
    world: World,
) -> None:
    """An export stored whole by an earlier torpor is answered as it is: made again, it
    would name as purged the results of sessions retention deleted since."""
    bid = (await finished(world, "fin", [{"doc": i} for i in range(3)])).batch_id
    whole = b'{"index": 0, "written": "whole"}\n'
    await world.services.store.put(keys.batch_results(bid, "jsonl"), whole)
    assert await world.batches.results(bid, "jsonl") == whole
    assert keys.batch_export(bid, generation=0) not in await batch_keys(world, bid)


async def _lines(world: World, batch_id: str) -> list[str]:
    return (await world.batches.results(batch_id, "jsonl")).decode().splitlines()


# -- retention -------------------------------------------------------------------------
# A batch goes once it is older than the retention period and no session of it is left:
# its manifest and everything beside it (documents, fan-out cursor, results, retries).

MONTH = timedelta(days=31)


async def batch_keys(world: World, batch_id: str) -> list[str]:
    return sorted(k for k in await all_keys(world.services.store, "") if batch_id in k)


async def finished(world: World, agent: str, docs: list[Any]) -> BatchManifest:
    manifest = await world.batches.submit(tenant="acme", agent=agent, documents=docs)

    async def done() -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(manifest.batch_id)).finished

    await eventually(done, timeout_s=10, what="the batch finishes")
    return manifest


async def purge(world: World, *, limit: int = 100) -> int:
    """One retention pass (up to ``limit`` sessions); the sessions it deleted."""
    retention = world.services.retention
    assert retention is not None
    done = await retention.sweep(
        now=world.services.clock.now(), keep=timedelta(days=30), windows=DAY, limit=limit
    )
    return len(done.purged)


async def test_a_finished_batch_goes_whole_after_the_retention_period(world: World) -> None:
    manifest = await finished(world, "fin", [{"doc": i} for i in range(3)])
    bid = manifest.batch_id
    await world.batches.results(bid, "jsonl")  # the export, beside the manifest
    assert keys.fanout(bid) not in await batch_keys(world, bid)  # the fan-out took its marker
    # As a fan-out that died after its last cursor write leaves it (no repair since).
    await world.services.batches.mark_fanning_out(bid)
    stored = await batch_keys(world, bid)
    assert keys.batch(bid) in stored and keys.batch_cursor(bid) in stored
    assert keys.batch_export(bid, generation=0) in stored
    clock = cast(ManualClock, world.services.clock)
    clock.advance(29 * DAY.total_seconds())
    await purge(world)
    assert await batch_keys(world, bid) == stored  # inside the period: all of it kept
    clock.advance(2 * DAY.total_seconds())
    assert await purge(world) == 3
    assert await purge(world) == 0
    assert await batch_keys(world, bid) == []  # the documents and results too
    for sid in manifest.sessions():
        with pytest.raises(SessionNotFound):
            await world.services.snapshots.header(sid)


async def test_a_batch_keeps_its_manifest_while_one_of_its_sessions_is_stored(
    world: World,
) -> None:
    """A batch's sessions go one by one (a bounded number per sweep, or each on its own
    day): its manifest, which its status and results are read through, stays until the
    last one has gone."""
    manifest = await finished(world, "fin", [{"doc": i} for i in range(3)])
    bid = manifest.batch_id
    cast(ManualClock, world.services.clock).advance(MONTH.total_seconds())
    assert await purge(world, limit=1) == 1
    assert await purge(world, limit=1) == 1
    assert keys.batch(bid) in await batch_keys(world, bid)
    progress = await world.batches.progress(bid)
    assert progress.total == 3
    assert await purge(world, limit=1) == 1
    await purge(world)
    assert await batch_keys(world, bid) == []


async def test_a_batch_cancelled_before_its_fan_out_goes_after_the_period(world: World) -> None:
    """No session of it ever existed, so none can be the last to go: the batch is judged
    by its own age."""
    manifest = await world.batches.accept(
        tenant="acme", agent="fin", documents=[{"doc": i} for i in range(3)]
    )
    bid = manifest.batch_id
    await world.batches.cancel(bid)
    await world.sweeper.sweep_once()
    stored = await batch_keys(world, bid)
    assert keys.batch_cancelled(bid) in stored and len(stored) >= 3  # documents too
    clock = cast(ManualClock, world.services.clock)
    clock.advance(29 * DAY.total_seconds())
    await purge(world)
    assert await batch_keys(world, bid) == stored
    clock.advance(2 * DAY.total_seconds())
    assert (await world.sweeper.sweep_once()).purged_batches == 1
    assert await batch_keys(world, bid) == []


async def test_a_batch_with_a_fan_out_under_way_is_kept(world: World) -> None:
    """Past the period but not fanned out (the reconciler still owes documents their
    sessions), a batch stays, whatever is stored of it."""
    manifest = await world.batches.accept(
        tenant="acme", agent="fin", documents=[{"doc": i} for i in range(3)]
    )
    cast(ManualClock, world.services.clock).advance(MONTH.total_seconds())
    await purge(world)
    assert keys.batch(manifest.batch_id) in await batch_keys(world, manifest.batch_id)


async def test_a_retried_documents_session_keeps_its_batch(world: World) -> None:
    """A retry generation's sessions are the batch's too: with every first attempt gone,
    one retried session still stored keeps the batch."""
    FLAKY["on"] = True
    manifest = await finished(world, "flaky", [{"doc": 0}, {"doc": 1, "fail": 1}])
    FLAKY["on"] = False
    try:
        assert await world.batches.retry(manifest.batch_id) == [1]

        async def retried() -> bool:
            await world.sweeper.sweep_once()
            return (await world.batches.progress(manifest.batch_id)).by_state == {"COMPLETED": 2}

        await eventually(retried, timeout_s=10, what="the retry completes")
    finally:
        FLAKY["on"] = True
    store = world.services.store
    for sid in manifest.sessions():  # every first attempt gone (as retention would)
        await store.delete(keys.snapshot(sid))
    retention = world.services.retention
    assert isinstance(retention, ObjectRetention)
    later = world.services.clock.now() + MONTH
    report = RetentionReport()
    await retention.sweep_batches(later, report)
    assert report.batches == 0
    assert keys.batch(manifest.batch_id) in await batch_keys(world, manifest.batch_id)
    await store.delete(keys.snapshot(manifest.session_id(1, attempt=1)))
    await retention.sweep_batches(later, report)
    assert report.batches == 1
    assert await batch_keys(world, manifest.batch_id) == []


async def test_a_batch_past_its_retention_period_takes_no_retry(world: World) -> None:
    """Its sessions may be gone by then: a purged one would look like a retry that died
    before making it, and be made again (a finished document run twice)."""
    FLAKY["on"] = True
    manifest = await finished(world, "flaky", [{"doc": 0}, {"doc": 1, "fail": 1}])
    cast(ManualClock, world.services.clock).advance(30 * DAY.total_seconds())
    with pytest.raises(BatchExpired):
        await world.batches.retry(manifest.batch_id)
    assert await world.services.batches.generations(manifest.batch_id) == []


class KilledBeforeTheManifest(Exception):
    pass


async def test_a_batch_whose_accept_died_before_its_manifest_leaves_nothing_behind(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documents are written before the manifest: an accept killed in between (no
    Idempotency-Key to retry it under) left them under no manifest, which is what
    retention visits batches through, so they stayed for ever."""
    store = world.services.store
    create = store.put_if_absent

    async def killed(key: str, data: bytes, *, durable: bool = True) -> str:
        if key.startswith(keys.BATCHES):
            raise KilledBeforeTheManifest(key)
        return await create(key, data, durable=durable)

    monkeypatch.setattr(store, "put_if_absent", killed)
    with pytest.raises(KilledBeforeTheManifest):
        await world.batches.accept(
            tenant="acme", agent="fin", documents=[{"doc": 0}], batch_id="b_killed"
        )
    monkeypatch.undo()
    assert await batch_keys(world, "b_killed")  # its documents (and fan-out marker)
    await world.sweeper.sweep_once()
    await world.sweeper.batches.drain()
    clock = cast(ManualClock, world.services.clock)
    clock.advance(29 * DAY.total_seconds())
    await world.sweeper.sweep_once()
    assert await batch_keys(world, "b_killed")  # inside the period: a retry may still come
    clock.advance(2 * DAY.total_seconds())
    await world.sweeper.sweep_once()
    await world.sweeper.batches.drain()
    assert await batch_keys(world, "b_killed") == []


class Rows:
    """The part of a ``ray.data.Dataset`` that ``submit_dataset`` reads."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def iter_rows(self) -> list[dict[str, Any]]:
        return self.rows


async def test_documents_stored_by_reference_for_a_refused_batch_go_after_the_period(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``submit_dataset(by_reference=True)`` stores every row before the batch is
    accepted; a batch then refused (no such agent) or a driver that dies half way left
    the rows under no manifest, for ever. A refused one stores nothing now, and what a
    driver that failed half way stored goes after the period."""
    from torpor.client import AsyncClient
    from torpor.errors import UnknownAgent

    client = AsyncClient.__new__(AsyncClient)  # no Ray: only the services are used
    client.tenant, client._services, client._batches = "acme", world.services, world.batches
    with pytest.raises(UnknownAgent):
        await client.submit_dataset(
            Rows([{"id": "d0"}, {"id": "d1"}]), agent="nope", by_reference=True
        )
    assert await all_keys(world.services.store, keys.BATCH_DATA) == [], "refused: stored"
    batches = world.services.batches
    put_document = batches.put_document

    async def dies_at_the_second(batch_id: str, index: int, document: object) -> str:
        if index == 1:
            raise OSError("the driver's node went away")
        return await put_document(batch_id, index, document)  # type: ignore[arg-type]

    monkeypatch.setattr(batches, "put_document", dies_at_the_second)
    with pytest.raises(OSError):
        await client.submit_dataset(
            Rows([{"id": "d0"}, {"id": "d1"}]), agent="fin", by_reference=True
        )
    stored = await all_keys(world.services.store, keys.BATCH_DATA)
    assert len(stored) == 1
    clock = cast(ManualClock, world.services.clock)
    clock.advance(MONTH.total_seconds() + 2 * 3600)
    await world.sweeper.sweep_once()
    assert await all_keys(world.services.store, keys.BATCH_DATA) == []


async def test_a_finished_batch_stays_finished_while_its_sessions_go_one_by_one(
    world: World,
) -> None:
    """Retention deletes a batch's sessions each on its own schedule, and only ended ones:
    a document whose session went has ended. The batch still reads finished (not its
    purged documents back to PENDING), and its results can still be exported."""
    manifest = await finished(world, "fin", [{"doc": i} for i in range(3)])
    bid = manifest.batch_id
    cast(ManualClock, world.services.clock).advance(MONTH.total_seconds())
    retention = world.services.retention
    assert retention is not None
    done = await retention.sweep(
        now=world.services.clock.now(), keep=timedelta(days=30), windows=DAY, limit=1
    )
    [(tenant, gone)] = done.purged
    await world.services.index.forget_session(tenant=tenant, session_id=gone)  # as the sweeper
    progress = await world.batches.progress(bid)
    assert progress.finished and progress.done == 3, progress.by_state
    assert progress.purged == 1 and progress.by_state == {"COMPLETED": 2}
    lines = {line["session_id"]: line for line in map(json.loads, await _lines(world, bid))}
    assert lines[gone]["state"] is None and "retention" in lines[gone]["error"]
    assert [line["state"] for sid, line in lines.items() if sid != gone] == ["COMPLETED"] * 2


async def test_a_cancel_request_cancelled_itself_leaves_the_fan_out_running(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel waits for this process's fan-out to stop at its next chunk. Cancelled
    while it waited (Serve cancels the handler of a client that went away), it cancelled
    the fan-out mid-chunk, whose own look at the marker then never ran: the sessions it
    had made past the cursor ran on in the cancelled batch. And the cancel swallowed its
    own cancellation and went on."""
    accept = await world.batches.accept(
        tenant="acme", agent="blk", documents=[{"doc": i} for i in range(DOCS)]
    )
    create, entered, release = world.batches._create, asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> int:
        made = await create(*args, **kwargs)
        entered.set()
        await release.wait()  # the chunk's sessions are made; its cursor not yet saved
        return made

    monkeypatch.setattr(world.batches, "_create", held)
    world.batches.start_fan_out(accept.batch_id)
    fan_out = world.batches._fan_outs[accept.batch_id]
    await entered.wait()
    cancel = asyncio.create_task(world.batches.cancel(accept.batch_id))
    await eventually(
        lambda: world.services.batches.is_cancelled(accept.batch_id),
        interval_s=0.001,
        what="the cancel wrote its marker and now waits for the fan-out",
    )
    cancel.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancel
    assert not fan_out.done(), "the fan-out goes on to its look at the marker"
    release.set()
    assert await fan_out == 4  # the first chunk, then it stopped
    memory_env.PROBE.release.set()  # those running (the cap's) go on to their end
    made = [accept.session_id(i) for i in range(4)]

    async def ended() -> bool:
        await world.activator.drain()
        loaded = [await world.services.snapshots.load(s) for s in made]
        return [x.state for x in loaded] == [S.CANCELLED] * 4

    await eventually(ended, timeout_s=10, what="the chunk's sessions cancelled")


async def test_a_batch_lists_each_documents_current_session_after_a_retry(world: World) -> None:
    """The batch listed each document's first session for ever: after a retry it counted
    the document COMPLETED, and its results named the retried session, while the list a
    client follows to each document's session still led to the FAILED attempt."""
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)
    bid = manifest.batch_id

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(bid)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 1}), timeout_s=10, what="fail")
    FLAKY["on"] = False
    try:
        assert await world.batches.retry(bid) == [1]
        await eventually(lambda: settled({"COMPLETED": 2}), timeout_s=10, what="retried")
    finally:
        FLAKY["on"] = True
    out = await batch_out(world.batches, bid, "acme")
    current = [manifest.session_id(0), manifest.session_id(1, attempt=1)]
    assert out.session_ids == current
    rows = [json.loads(x) for x in await _lines(world, bid)]
    assert [r["session_id"] for r in rows] == current


async def test_a_batch_of_thousands_shows_a_page_of_its_sessions_and_a_cursor_to_the_rest(
    world: World,
) -> None:
    """A batch listed every document's session in each answer: 10,000 ids (a third
    of a megabyte) on every poll of its progress. It lists the first page, and a cursor from
    which a walk of its sessions, a bounded page at a time, finds every one in order."""
    docs: list[Any] = [{"doc": i} for i in range(2 * SESSIONS_PAGE_MAX + 5)]
    manifest = await world.batches.accept(tenant="acme", agent="fin", documents=docs)
    bid = manifest.batch_id
    out = await batch_out(world.batches, bid, "acme")
    assert out.session_ids == manifest.sessions()[:SESSIONS_PAGE]
    assert out.next_cursor is not None and out.links["sessions"] == f"/v1/batches/{bid}/sessions"
    walked, cursor, pages = list(out.session_ids), out.next_cursor, 0
    while cursor is not None:
        page = await world.batches.session_page(bid, cursor=cursor, limit=SESSIONS_PAGE_MAX)
        assert page.start == len(walked) and len(page.session_ids) <= SESSIONS_PAGE_MAX
        walked.extend(page.session_ids)
        cursor, pages = page.next_cursor, pages + 1
    assert walked == manifest.sessions() and pages == 2  # 1,000 and the last 905


@pytest.mark.parametrize(
    ("cursor", "limit"),
    [("x", 10), ("-1", 10), ("3", 10), ("²", 10), ("9" * 40, 10), ("0", 0), (None, 1001)],
    ids=["text", "negative", "past-the-end", "unicode-digit", "huge", "no-limit", "over-max"],
)
async def test_a_cursor_or_limit_no_page_of_the_batch_hands_out_is_refused_typed(
    world: World, cursor: str | None, limit: int
) -> None:
    docs: list[Any] = [{"doc": i} for i in range(3)]
    manifest = await world.batches.accept(tenant="acme", agent="fin", documents=docs)
    with pytest.raises(InvalidRequest):
        await world.batches.session_page(manifest.batch_id, cursor=cursor, limit=limit)


async def test_a_session_made_after_its_batch_was_cancelled_never_starts(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry (or fan-out) looks for the cancel marker, then makes its sessions: a cancel
    in between found none of them to cancel, and a made session with a free running slot
    started at once and ran its document through (here to COMPLETED) before the maker's
    second look at the marker delivered its cancel."""
    FLAKY["on"] = True
    docs: list[Any] = [{"doc": 0}, {"doc": 1, "fail": 1}]
    manifest = await world.batches.submit(tenant="acme", agent="flaky", documents=docs)
    bid = manifest.batch_id

    async def settled(expect: dict[str, int]) -> bool:
        await world.sweeper.sweep_once()
        return (await world.batches.progress(bid)).by_state == expect

    await eventually(lambda: settled({"COMPLETED": 1, "FAILED": 1}), timeout_s=10, what="fail")
    await world.activator.drain()  # the first sessions' slots are given back: one is free
    create = world.batches._create

    async def cancelled_first(*args: Any, **kwargs: Any) -> int:
        await world.batches.cancel(bid)  # the operator's cancel, just before the creates
        return await create(*args, **kwargs)

    monkeypatch.setattr(world.batches, "_create", cancelled_first)
    FLAKY["on"] = False  # left alone, the retried document would now complete
    try:
        assert await world.batches.retry(bid) == [1]
        await world.activator.drain()
        retried = await world.services.snapshots.load(manifest.session_id(1, attempt=1))
        assert retried.state is S.CANCELLED
        assert [h.state for h in retried.history] == [S.CANCELLED], "it never ran"
    finally:
        FLAKY["on"] = True


async def test_progress_reads_the_snapshots_the_index_lacks_side_by_side(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions the index does not hold (it was lost; or retention deleted them past the
    period) are looked for in their snapshots: one after the other, a GET of a 10,000-
    document batch made 10,000 store reads in a row (minutes on S3), on every poll."""
    manifest = await finished(world, "fin", [{"doc": i} for i in range(DOCS)])
    in_flight = peak = 0
    header = world.services.snapshots.header

    async def counted(session_id: str) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0)  # a store read yields: the others may start meanwhile
            return await header(session_id)
        finally:
            in_flight -= 1

    async def lost(session_ids: list[str]) -> dict[str, SessionState]:
        return {}

    monkeypatch.setattr(world.services.snapshots, "header", counted)
    monkeypatch.setattr(world.services.index, "session_states", lost)
    progress = await world.batches.progress(manifest.batch_id)
    assert progress.by_state == {"COMPLETED": DOCS}
    assert peak == DOCS


@pytest.mark.parametrize("by_reference", [False, True], ids=["inline", "by-reference"])
async def test_a_dataset_submitted_again_under_its_batch_id_is_one_batch(
    world: World, by_reference: bool
) -> None:
    """A driver that died after its submit and ran again made a second batch of the same
    rows (a new id each call): every document processed twice. Named by the caller, the
    second submit finds the first batch."""
    from torpor.client import AsyncClient
    from torpor.ids import new_batch_id

    client = AsyncClient.__new__(AsyncClient)  # no Ray: only the services are used
    client.tenant, client._services, client._batches = "acme", world.services, world.batches
    rows = Rows([{"id": "d0"}, {"id": "d1"}])
    batch_id = new_batch_id()
    first = await client.submit_dataset(
        rows, agent="fin", batch_id=batch_id, by_reference=by_reference
    )
    again = await client.submit_dataset(
        rows, agent="fin", batch_id=batch_id, by_reference=by_reference
    )
    assert first == again == batch_id
    assert (await client.progress(batch_id))["total"] == 2
    sessions = [sid async for page in world.services.snapshots.session_ids() for sid in page]
    assert len(sessions) == 2, "each row once"
