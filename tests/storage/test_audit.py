"""The audit chain: concurrent appends stay one valid chain; any tampering shows."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from storage import keys
from storage.audit import Checkpoint, ObjectAudit, checkpoint_key
from torpor.errors import ObjectExists, StorageUnavailable
from torpor.ports import ObjectStore


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    name = "local_store" if request.param == "local" else "s3_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def fields(i: int) -> dict[str, object]:
    return {
        "at": datetime.now(UTC),
        "source": "oa",
        "verdict": "accepted",
        "event_id": f"e-{i}",
        "body_sha256": hashlib.sha256(str(i).encode()).hexdigest(),
    }


async def test_concurrent_appends_form_one_valid_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w1")
    records = await asyncio.gather(*(log.append(**fields(i)) for i in range(300)))
    records += [await log.append(**fields(i)) for i in range(300, 305)]
    assert sorted(r.seq for r in records) == list(range(1, 306))
    check = await log.verify()
    assert check.ok and check.records == 305
    blocks = (await store.list(keys.audit_prefix("w1"))).keys
    assert 2 <= len(blocks) < 305, "records are group-committed into blocks"


async def test_editing_a_record_breaks_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w2")
    for i in range(5):
        await log.append(**fields(i))
    key = keys.audit_record("w2", 3)
    lines = (await store.get(key)).data.decode().splitlines()
    record = json.loads(lines[0])
    record["verdict"] = "duplicate"
    await store.put(key, "\n".join([json.dumps(record), *lines[1:]]).encode())
    check = await log.verify()
    assert not check.ok and check.broken_at == 3 and "altered" in check.why


async def test_removing_a_block_breaks_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w3")
    for i in range(4):
        await log.append(**fields(i))
    await store.delete(keys.audit_record("w3", 2))
    check = await log.verify()
    assert not check.ok and check.broken_at == 2


async def test_writers_keep_separate_streams(store: ObjectStore) -> None:
    a, b = ObjectAudit(store), ObjectAudit(store)
    await asyncio.gather(*(a.append(**fields(i)) for i in range(10)))
    await asyncio.gather(*(b.append(**fields(i)) for i in range(7)))
    checks = await a.verify_all()
    assert {s: c.records for s, c in checks.items()} == {a.stream: 10, b.stream: 7}
    assert all(c.ok for c in checks.values())


async def test_failed_write_fails_the_waiters_and_keeps_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w4")
    await log.append(**fields(0))
    await store.put(keys.audit_record("w4", 2), b"squatter")  # the next block is taken
    with pytest.raises(ObjectExists):
        await log.append(**fields(1))
    check = await log.verify()
    assert not check.ok and check.records == 1  # the squatter is visible as a break


class LosesOneAnswer:
    """A store whose next create-only write of ``key`` lands, but whose answer is lost."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        etag = await self.store.put_if_absent(key, data, durable=durable)
        if key == self.key:
            self.key = ""
            raise StorageUnavailable("injected: the answer was lost")
        return etag


async def test_a_block_whose_answer_was_lost_does_not_wedge_the_writer(
    store: ObjectStore,
) -> None:
    lossy = LosesOneAnswer(store, keys.audit_record("w5", 2))
    log = ObjectAudit(lossy, writer="w5")  # type: ignore[arg-type]
    await log.append(**fields(0))
    with pytest.raises(StorageUnavailable):
        await log.append(**fields(1))  # landed as block 2; nobody was told
    assert not log.healthy and log.last_error and "answer was lost" in log.last_error
    # Re-batched: the next records differ from block 2, so a blind retry would meet 412.
    records = await asyncio.gather(*(log.append(**fields(i)) for i in range(2, 5)))
    assert [r.seq for r in records] == [3, 4, 5] and log.healthy
    check = await log.verify()
    assert check.ok and check.records == 5


class CancelledUnder:
    """A store whose next create-only write of ``key`` is cancelled under its caller
    (its own call's task cancelled as the store closes), the caller not asked to stop.
    ``held``: the write waits there first, until the test lets it go on."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key
        self.reached, self.held = asyncio.Event(), asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        if key == self.key:
            self.key = ""
            self.reached.set()
            await self.held.wait()
            raise asyncio.CancelledError
        return await self.store.put_if_absent(key, data, durable=durable)


async def test_a_write_cancelled_under_the_writer_answers_every_waiter(
    store: ObjectStore,
) -> None:
    cancelling = CancelledUnder(store, keys.audit_record("w8", 2))
    log = ObjectAudit(cancelling, writer="w8")  # type: ignore[arg-type]
    await log.append(**fields(0))
    first = asyncio.create_task(log.append(**fields(1)))
    await cancelling.reached.wait()
    queued = asyncio.create_task(log.append(**fields(2)))  # behind the write in flight
    cancelling.held.set()
    # A deadline, not a pause: before, both waited on futures nothing would settle.
    outcomes = await asyncio.wait_for(
        asyncio.gather(first, queued, return_exceptions=True), timeout=10
    )
    assert all(isinstance(o, StorageUnavailable) for o in outcomes), outcomes
    assert not log.healthy
    record = await log.append(**fields(3))  # a new flush writes on
    assert record.seq == 2 and log.healthy
    check = await log.verify()
    assert check.ok and check.records == 2


async def test_a_checkpoint_cancelled_after_its_block_landed_answers_with_the_records(
    store: ObjectStore,
) -> None:
    """The block is written; the checkpoint due after it is cancelled under the writer:
    its callers hear their records (they are durable), not a 503 that would have the
    sender deliver it again; closing after that raises nothing and checkpoints."""
    cancelling = CancelledUnder(store, checkpoint_key("w10", 1))
    cancelling.held.set()
    log = ObjectAudit(cancelling, writer="w10", checkpoint_every=1)  # type: ignore[arg-type]
    record = await asyncio.wait_for(log.append(**fields(0)), timeout=10)
    assert record.seq == 1 and log.healthy
    await log.close()  # the flusher ended cancelled: no CancelledError for the closer
    check = await log.verify()
    assert check.ok and check.records == 1
    assert (await store.get(checkpoint_key("w10", 1))).data  # written by close


async def test_a_flush_cancelled_itself_answers_its_waiters(store: ObjectStore) -> None:
    """The flusher's own task cancelled (the loop closing under it): its waiters hear
    503, not nothing."""
    held = CancelledUnder(store, keys.audit_record("w9", 1))
    log = ObjectAudit(held, writer="w9")  # type: ignore[arg-type]
    waiter = asyncio.create_task(log.append(**fields(0)))
    await held.reached.wait()
    assert log._flusher is not None
    log._flusher.cancel()
    with pytest.raises(StorageUnavailable):
        await asyncio.wait_for(waiter, timeout=10)


async def test_a_flush_cancelled_before_its_first_step_answers_its_waiters(
    store: ObjectStore,
) -> None:
    """Cancelled before it ran at all (the loop shutting down as the first record came):
    none of the flusher's own handling ran, and its waiter was left on a future nobody
    would settle."""
    log = ObjectAudit(store, writer="w11")
    waiter = asyncio.create_task(log.append(**fields(0)))
    await asyncio.sleep(0)  # one turn: the record queued, its flusher made, not yet run
    assert log._flusher is not None and not log._flusher.done()
    log._flusher.cancel()
    with pytest.raises(StorageUnavailable):
        await asyncio.wait_for(waiter, timeout=10)
    assert (await log.append(**fields(1))).seq == 1  # the next record writes as the first


async def test_a_flush_that_raises_answers_its_waiters_with_the_error(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush ended by an error its store calls did not raise (a record that cannot be
    hashed: a bug) left its waiter on a future nobody would settle."""
    log = ObjectAudit(store, writer="w12")

    def broken(self: object) -> str:
        raise RuntimeError("a record that cannot be hashed")

    monkeypatch.setattr("storage.audit.AuditRecord.digest", broken)
    with pytest.raises(RuntimeError, match="cannot be hashed"):
        await asyncio.wait_for(log.append(**fields(0)), timeout=10)


async def test_a_foreign_block_is_left_visible_and_the_writer_moves_past_it(
    store: ObjectStore,
) -> None:
    log = ObjectAudit(store, writer="w6")
    await log.append(**fields(0))
    await store.put(keys.audit_record("w6", 2), b"squatter")
    with pytest.raises(ObjectExists):
        await log.append(**fields(1))
    assert not log.healthy
    assert (await log.append(**fields(2))).seq == 2  # written after the squatter
    assert log.healthy
    check = await log.verify()
    assert not check.ok and check.broken_at == 2  # the squatter is still a visible break


async def test_the_stream_is_named_by_the_callers_clock(store: ObjectStore) -> None:
    log = ObjectAudit(store)
    assert (await log.verify()).records == 0
    await log.append(**{**fields(0), "at": datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)})
    assert log.stream.startswith("20310504T030201-")


async def test_deleting_the_last_block_after_a_checkpoint_shows(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w7", key="k" * 32, checkpoint_every=1)
    for i in range(3):
        await log.append(**fields(i))
    assert (await log.verify()).checkpoints == "signed"
    await store.delete(keys.audit_record("w7", 3))
    check = await log.verify()
    assert not check.ok and "truncated" in check.why and "block 3" in check.why


async def test_deleting_a_whole_stream_shows(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w8")
    for i in range(3):
        await log.append(**fields(i))
    for key in (await store.list(keys.audit_prefix("w8"))).keys:
        await store.delete(key)
    checks = await ObjectAudit(store).verify_all()
    assert "w8" in checks and not checks["w8"].ok and "truncated" in checks["w8"].why


async def test_a_checkpoint_rewritten_without_the_key_is_refused(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w9", key="k" * 32, checkpoint_every=1)
    for i in range(2):
        await log.append(**fields(i))
    await store.delete(keys.audit_record("w9", 2))
    forged = Checkpoint.make("w9", 2, 1, "0" * 64, b"guess")
    await store.delete(checkpoint_key("w9", 2))
    await store.put(checkpoint_key("w9", 2), forged.model_dump_json().encode())
    check = await log.verify()
    assert not check.ok and "forged" in check.why


async def test_without_a_key_checkpoints_say_they_are_unsigned(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w10")
    await log.append(**fields(0))
    await log.close()  # closing vouches for the head
    check = await log.verify()
    assert check.ok and check.checkpoints == "unsigned (no audit key)"
    await store.delete(keys.audit_record("w10", 1))
    assert not (await log.verify()).ok


def test_closing_on_another_loop_than_the_flushs_raises_nothing(tmp_path: Path) -> None:
    """Services opened on one loop and closed on another: the flush, begun on the first,
    is not waited for from the second (it cannot be), and the close still checkpoints."""
    from storage.local_store import LocalObjectStore

    store = LocalObjectStore(tmp_path / "objects")
    log = ObjectAudit(store, writer="w11")
    asyncio.run(log.append(**fields(0)))  # its flush began, and ended, on that loop
    asyncio.run(log.close())
    check = asyncio.run(log.verify())
    asyncio.run(store.close())
    assert check.ok and check.records == 1
