"""A batch's fan-out killed -9 mid-way is resumed by the reconciler from the manifest:
every document ends with exactly one session."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from tests.runtime.test_sweeper import flush_index
from tests.support.crash import run_killed_at
from tests.support.harness import Env, local_env
from torpor.batches import FanOutCursor
from torpor.errors import BatchNotFinished
from torpor.faults import CrashPoint
from torpor.ports import SlotEntry
from torpor.service.batches import BatchService
from torpor.service.sweeper import Sweeper

pytestmark = pytest.mark.redis

DOCS = 7
EXTRA = {"batches": {"fanout_chunk": 3}}
FAN_OUT_IN_CHILD = """
import asyncio, sys
from pathlib import Path
from tests.support.harness import local_env
from torpor.service.batches import BatchService

async def main() -> None:
    extra = {"batches": {"fanout_chunk": 3}}
    async with local_env(Path(sys.argv[1]), sys.argv[2], sys.argv[3], extra=extra) as env:
        await BatchService(env.control).submit(
            tenant="acme", agent="purchase", batch_id="b_crash",
            documents=[{"doc": f"PR-{i}", "amount": 10.0} for i in range(int(sys.argv[4]))],
        )

asyncio.run(main())
"""


async def test_a_fan_out_killed_mid_way_resumes_with_one_session_per_document(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        # Died after the first chunk's sessions, before its cursor was saved.
        assert len((await env.services.store.list("snapshots/")).keys) == 3
        assert await env.services.batches.cursor("b_crash") == FanOutCursor(next=0)
        sweeper = Sweeper(env.control)
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        report = await sweeper.sweep_once()
        assert report.fan_outs == 1
        await sweeper.batches.drain()
        await _every_document_has_one_session(env, sweeper)


async def test_a_fan_out_killed_mid_way_and_then_its_index_lost_is_resumed_after_repair(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The fan-out's timer was in the index: lost with it, nothing but repair can send the
    reconciler back to the batch, whose cursor stays short of its total for ever (never
    finished, never retained)."""
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    await flush_index(redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        assert (await env.services.store.list(keys.FANOUTS)).keys == [keys.fanout("b_crash")]
        sweeper = Sweeper(env.control)
        report = await sweeper.sweep_once()  # the index is not intact: repair runs
        assert report.repaired_waits == 3  # the first chunk's sessions, waiting
        await sweeper.batches.drain()
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        report = await sweeper.sweep_once()
        assert report.fan_outs == 1
        await sweeper.batches.drain()
        await _every_document_has_one_session(env, sweeper)


async def test_a_resumed_fan_out_leaves_no_running_slot_registered_for_an_ended_session(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Killed -9 after a chunk's sessions, before its cursor: the resumed fan-out registers
    the whole chunk under the batch's running caps again, sessions that ended meanwhile
    too. Their creation finds each one made and asks for its activation again, and an
    ended session's activation forgets its registration: without that request (or were
    the registration written after it), nothing would ever take those records away."""
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        manifest = await BatchService(env.control).get("b_crash")
        ended = [manifest.session_id(i) for i in range(3)]  # the chunk the child made
        for sid in ended:
            await env.control.cancel(sid)
        assert [(await env.load(sid)).state.value for sid in ended] == ["CANCELLED"] * 3
        sweeper = Sweeper(env.control)
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        assert (await sweeper.sweep_once()).fan_outs == 1
        await sweeper.batches.drain()
        slots = env.services.slots
        assert slots is not None
        # A member with no registration enters uncapped: nothing is left of theirs.
        entries = [await slots.enter(member=sid, ttl=timedelta(minutes=1)) for sid in ended]
        assert entries == [SlotEntry.UNCAPPED] * 3


async def test_a_batch_cancelled_after_its_fan_out_was_killed_mid_way_ends_every_session(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Killed -9 after a chunk's sessions, before its cursor: the cancel reads the cursor
    (0) and sees none of them, and the resumed fan-out, finding the batch cancelled, made
    nothing more; the chunk's sessions stayed SUSPENDED (running on) in a cancelled batch."""
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        await BatchService(env.control).cancel("b_crash")
        sweeper = Sweeper(env.control)
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        assert (await sweeper.sweep_once()).fan_outs == 1
        await sweeper.batches.drain()
        made = [k.rpartition("/")[2] for k in (await env.services.store.list("snapshots/")).keys]
        assert len(made) == 3
        assert [(await env.load(sid)).state.value for sid in made] == ["CANCELLED"] * 3


async def test_a_cancelled_batch_counts_the_sessions_its_killed_fan_out_left_running(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Killed -9 after a chunk's sessions, before its cursor: progress counted every
    document past the cursor as CANCELLED once the batch was, the chunk's three SUSPENDED
    sessions among them, and called the batch finished while they ran on (and its results
    answered 409 meanwhile)."""
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        batches = BatchService(env.control)
        progress = await batches.cancel("b_crash")
        assert progress.by_state == {"SUSPENDED": 3, "CANCELLED": DOCS - 3}
        assert not progress.finished
        sweeper = Sweeper(env.control)
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        await sweeper.sweep_once()  # the fan-out resumes and ends what it made
        await sweeper.batches.drain()
        progress = await batches.progress("b_crash")
        assert progress.by_state == {"CANCELLED": DOCS} and progress.finished


async def test_results_read_while_a_cancel_is_under_way_are_not_kept(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Read right after the cancel, the batch counts the documents past its cursor as
    cancelled, but the killed fan-out's sessions are still SUSPENDED: that export was
    kept, and every later read answered SUSPENDED for documents that ended CANCELLED."""
    killed_mid_fan_out(tmp_path, redis_url, redis_prefix)
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        batches = BatchService(env.control)
        await batches.cancel("b_crash")
        with pytest.raises(BatchNotFinished):
            await batches.results("b_crash", "jsonl")
        sweeper = Sweeper(env.control)
        env.clock.advance(env.services.settings.reconciler.wake_grace_s + 1)
        await sweeper.sweep_once()  # the fan-out resumes and ends what it made
        await sweeper.batches.drain()
        lines = (await batches.results("b_crash", "jsonl")).decode().splitlines()
        assert [json.loads(line)["state"] for line in lines] == ["CANCELLED"] * DOCS


async def test_an_accept_killed_before_its_manifest_leaves_nothing_after_the_period(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Killed -9 between the documents and the manifest: nothing names the documents but
    the accept note written before them, through which retention deletes them (and the
    note) once the period is over."""
    run_killed_at(
        CrashPoint.BATCH_DOCUMENTS,
        FAN_OUT_IN_CHILD,
        str(tmp_path),
        redis_url,
        redis_prefix,
        str(DOCS),
    )
    async with local_env(tmp_path, redis_url, redis_prefix, extra=EXTRA) as env:
        store = env.services.store
        assert (await store.list(keys.BATCHES)).keys == [], "died before its manifest"
        assert (await store.list(keys.batch_data("b_crash"))).keys, "its documents stay"
        assert (await store.list(keys.BATCH_ACCEPTS)).keys == [keys.batch_accepting("b_crash")]
        sweeper = Sweeper(env.control)
        await sweeper.sweep_once()  # within the period: kept
        assert (await store.list(keys.batch_data("b_crash"))).keys
        retention = timedelta(seconds=env.services.settings.storage.retention_s)
        env.clock.advance((retention + timedelta(hours=2)).total_seconds())
        await sweeper.sweep_once()
        assert (await store.list(keys.batch_data("b_crash"))).keys == []
        assert (await store.list(keys.BATCH_ACCEPTS)).keys == []


def killed_mid_fan_out(tmp_path: Path, redis_url: str, redis_prefix: str) -> None:
    """A child process submits the batch and is killed after its first chunk."""
    run_killed_at(
        CrashPoint.BATCH_FANOUT_CHUNK,
        FAN_OUT_IN_CHILD,
        str(tmp_path),
        redis_url,
        redis_prefix,
        str(DOCS),
    )


async def _every_document_has_one_session(env: Env, sweeper: Sweeper) -> None:
    store = env.services.store
    manifest = await BatchService(env.control).get("b_crash")
    stored = sorted(k.rpartition("/")[2] for k in (await store.list("snapshots/")).keys)
    assert stored == sorted(manifest.sessions()) and len(stored) == DOCS
    for i, sid in enumerate(manifest.sessions()):
        snap = await env.load(sid)
        assert snap.input == {"doc": f"PR-{i}", "amount": 10.0} and snap.batch_id == "b_crash"
    progress = await BatchService(env.control).progress("b_crash")
    assert progress.by_state == {"SUSPENDED": DOCS} and progress.created == DOCS
    # Done: the safety-net timer and the marker are gone, a later sweep resumes nothing.
    assert (await store.list(keys.FANOUTS)).keys == []
    env.clock.advance(3600)
    assert (await sweeper.sweep_once()).fan_outs == 0
