"""Batches at document-set scale: accepted before any session exists, admitted under a cap
on RUNNING sessions, cancelled, retried and exported (memory adapters: no service is the
point here; the crash-resume of the fan-out is in tests/faults, HTTP in tests/ingress)."""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pyarrow.parquet as pq
import pytest
from pydantic import JsonValue

from actors.wiring import open_services, session_runtime
from tests.conftest import eventually
from tests.runtime import memory_env
from tests.runtime.memory_env import plan_agent, reset
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.clock import ManualClock
from torpor.errors import BatchNotFinished, SessionNotFound
from torpor.lifecycle import SessionState
from torpor.models import Message
from torpor.ports import TimerKind
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.batches import BatchService
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

S = SessionState
CAP = 2
DOCS = 6
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
    settings = Settings.build(
        {
            "storage": {"object_store_url": "memory://", "index_url": "memory://"},
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


async def _lines(world: World, batch_id: str) -> list[str]:
    return (await world.batches.results(batch_id, "jsonl")).decode().splitlines()
