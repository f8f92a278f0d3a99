"""Audit compaction: old blocks become one archive, and the chain still verifies, still
shows a cut, and survives a compaction that stopped half way."""

from __future__ import annotations

import asyncio
import json
import zlib
from datetime import UTC, datetime, timedelta

import pytest

from storage import audit_archive, keys
from storage.audit import ObjectAudit
from storage.local_store import LocalObjectStore
from storage.memory_store import MemoryObjectStore
from storage.retention import ObjectRetention
from tests.storage.test_audit import fields
from torpor.ports import ListPage, ObjectStore, StoredObject

BLOCKS = 24


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    name = "local_store" if request.param == "local" else "s3_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


async def written(store: ObjectStore, stream: str) -> ObjectAudit:
    log = ObjectAudit(store, writer=stream, key="k" * 32, checkpoint_every=4)
    for i in range(BLOCKS):  # one at a time: one block each
        await log.append(**fields(i))
    await log.close()  # the last checkpoint is written
    return log


async def blocks(store: ObjectStore, stream: str) -> list[str]:
    return (await store.list(keys.audit_prefix(stream))).keys


async def test_a_compacted_stream_keeps_every_record_and_still_verifies(
    store: ObjectStore,
) -> None:
    log = await written(store, "wa")
    archived = (await ObjectRetention(store).sweep_audit()).archived
    assert archived == BLOCKS - audit_archive.KEEP_BLOCKS
    assert len(await blocks(store, "wa")) == audit_archive.KEEP_BLOCKS
    check = await log.verify()
    assert check.ok and check.records == BLOCKS and check.checkpoints == "signed"
    await log.append(**fields(99))  # the writer carries on after its archived past
    assert (await log.verify()).records == BLOCKS + 1
    assert "wa" in await ObjectAudit(store).streams()


async def test_deleting_an_archive_shows(store: ObjectStore) -> None:
    log = await written(store, "wb")
    await audit_archive.compact(store, "wb")
    [archive] = await audit_archive.archives(store, "wb")
    await store.delete(archive.key)
    check = await log.verify()
    assert not check.ok and "missing" in check.why


async def test_cutting_the_stream_after_a_compaction_still_shows(store: ObjectStore) -> None:
    log = await written(store, "wc")
    await audit_archive.compact(store, "wc")
    await store.delete(keys.audit_record("wc", BLOCKS))
    check = await log.verify()
    assert not check.ok and "truncated" in check.why


class DeletesFailAfter(LocalObjectStore):
    budget = 3

    async def delete(self, key: str) -> None:
        if self.budget <= 0:
            raise OSError("the process died here")
        self.budget -= 1
        await super().delete(key)


async def test_a_compaction_stopped_half_way_verifies_and_is_finished_next_time(
    tmp_path: object,
) -> None:
    from pathlib import Path

    store = DeletesFailAfter(Path(str(tmp_path)))
    log = await written(store, "wd")
    with pytest.raises(OSError):
        await audit_archive.compact(store, "wd")
    assert len(await audit_archive.archives(store, "wd")) == 1
    assert (await log.verify()).ok  # the archive and the leftover blocks overlap
    store.budget = 10_000
    assert await audit_archive.compact(store, "wd") == 0  # too few new blocks to archive
    assert len(await blocks(store, "wd")) == audit_archive.KEEP_BLOCKS
    check = await log.verify()
    assert check.ok and check.records == BLOCKS


class Held(LocalObjectStore):
    """Stops the first write (or read) of a key starting with ``at`` until released: a
    compactor caught there while another one (a second reconciler) runs."""

    def __init__(self, root: object, at: str, on: str) -> None:
        from pathlib import Path

        super().__init__(Path(str(root)))
        self.at, self.on = at, on
        self.reached, self.release = asyncio.Event(), asyncio.Event()

    async def _hold(self, key: str, op: str) -> None:
        if op == self.on and key.startswith(self.at) and not self.reached.is_set():
            self.reached.set()
            await self.release.wait()

    async def put_if_absent(self, key: str, data: bytes, *, durable: bool = True) -> str:
        await self._hold(key, "put")
        return await super().put_if_absent(key, data, durable=durable)

    async def get(self, key: str, *, max_bytes: int | None = None) -> StoredObject:
        await self._hold(key, "get")
        return await super().get(key, max_bytes=max_bytes)


async def test_two_compactions_at_once_write_overlapping_archives_that_still_verify(
    tmp_path: object,
) -> None:
    """A compaction lists the blocks, a second one (it listed later, so it saw more
    blocks) archives and deletes a longer run, then the first writes its shorter archive
    of the same blocks. The archives overlap; the chain is intact."""
    store = Held(tmp_path, audit_archive.ARCHIVES, "put")
    log = await written(store, "wf")
    first = asyncio.create_task(audit_archive.compact(store, "wf"))
    await store.reached.wait()  # it read blocks 1..20 and is about to archive them
    for i in range(4):
        await log.append(**fields(100 + i))
    assert await audit_archive.compact(store, "wf") == BLOCKS  # blocks 1..24
    store.release.set()
    await first
    assert len(await audit_archive.archives(store, "wf")) == 2
    check = await log.verify()
    assert check.ok, check.why
    assert check.records == BLOCKS + 4
    await audit_archive.compact(store, "wf")  # and compaction carries on after both
    assert (await log.verify()).ok


async def test_a_compaction_whose_blocks_another_one_archived_meanwhile_stops_quietly(
    tmp_path: object,
) -> None:
    store = Held(tmp_path, keys.audit_prefix("wg"), "get")
    log = await written(store, "wg")
    first = asyncio.create_task(audit_archive.compact(store, "wg"))
    await store.reached.wait()  # it listed the blocks, and reads the first of them
    assert await audit_archive.compact(store, "wg") == BLOCKS - audit_archive.KEEP_BLOCKS
    store.release.set()
    assert await first == 0  # the other one archived them: nothing to do, no error
    check = await log.verify()
    assert check.ok and check.records == BLOCKS


async def test_an_overlapping_archive_that_disagrees_shows(store: ObjectStore) -> None:
    """Overlapping archives are copies of the same blocks: one whose copy differs (its
    last archived block replaced by another stream's) breaks the chain there."""
    log = await written(store, "wh")
    await audit_archive.compact(store, "wh")
    [archive] = await audit_archive.archives(store, "wh")
    blocks = audit_archive.decode((await store.get(archive.key)).data)
    assert blocks is not None
    other = await ObjectAudit(store, writer="other").append(**fields(7))
    after = (await store.get(keys.audit_record("wh", archive.last + 1))).data
    forged = [*blocks[:-1], other.model_dump_json().encode(), after]
    await store.put(
        audit_archive.archive_key("wh", 1, archive.last + 1), audit_archive.encode(forged)
    )
    check = await log.verify()
    assert not check.ok and "disagree" in check.why


class CompactsDuringListing(LocalObjectStore):
    """Runs a whole compaction of ``stream`` right after the first listing of ``prefix``
    is taken: a reconciler compacting while an operator verifies or reads the stream."""

    def __init__(self, root: object, stream: str, prefix: str) -> None:
        from pathlib import Path

        super().__init__(Path(str(root)))
        self.stream, self.prefix, self.armed = stream, prefix, False

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        page = await super().list(prefix, start_after=start_after, limit=limit)
        if self.armed and prefix == self.prefix:
            self.armed = False
            assert await audit_archive.compact(self, self.stream) > 0
        return page


@pytest.mark.parametrize("between", ["archives", "blocks"])
async def test_a_compaction_during_a_verify_is_no_broken_chain(
    tmp_path: object, between: str
) -> None:
    """The verifier listed the archives (or the blocks), then a compaction archived and
    deleted blocks: the chain is intact and must verify, not show a gap or fail."""
    prefix = (
        audit_archive.archives_prefix("wv") if between == "archives" else keys.audit_prefix("wv")
    )
    store = CompactsDuringListing(tmp_path, "wv", prefix)
    log = await written(store, "wv")
    store.armed = True
    check = await log.verify()
    assert not store.armed  # the compaction ran mid-verify
    assert check.ok and check.records == BLOCKS, check.why


async def test_the_recent_records_are_read_while_a_compaction_runs(tmp_path: object) -> None:
    store = CompactsDuringListing(tmp_path, "wr", keys.audit_prefix("wr"))
    log = await written(store, "wr")
    store.armed = True
    records = await log.recent(blocks=8)
    assert not store.armed
    assert [r.seq for r in records] == list(range(BLOCKS - 3, BLOCKS + 1))


class CountsListed(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.listed = 0

    async def list(
        self, prefix: str, *, start_after: str | None = None, limit: int = 1000
    ) -> ListPage:
        page = await super().list(prefix, start_after=start_after, limit=limit)
        self.listed += len(page.keys)
        return page


async def test_a_compaction_lists_a_bounded_number_of_blocks_however_long_the_backlog() -> None:
    """A stream far behind (a busy writer, or one from before archives) is compacted a run
    a visit; each visit lists about that run, not the whole stream again."""
    store = CountsListed()
    backlog = 4 * audit_archive.MAX_BLOCKS
    for block in range(1, backlog + 1):  # the bytes are copied verbatim: any will do
        await store.put(keys.audit_record("wl", block), b"{}")
    run = audit_archive.MAX_BLOCKS + audit_archive.KEEP_BLOCKS
    for _ in range(3):
        store.listed = 0
        assert await audit_archive.compact(store, "wl") == audit_archive.MAX_BLOCKS
        assert store.listed <= 2 * run


async def test_a_block_that_is_not_utf8_is_archived_as_it_is_and_shows_as_a_broken_chain(
    store: ObjectStore,
) -> None:
    """A tampered (or bit-rotten) block whose bytes are not UTF-8 is compacted like any
    other: copied as it is, so ``verify`` shows the same break, and the sweep goes on.
    Compaction decoded it strictly: the whole retention sweep raised UnicodeDecodeError
    at every visit of the stream, before it purged a single session."""
    log = await written(store, "wt")
    key = keys.audit_record("wt", 3)
    tampered = (await store.get(key)).data + b"\n\xff\xfe not utf-8\n"
    await store.delete(key)
    await store.put(key, tampered)
    before = await log.verify()
    assert not before.ok and before.why == "a record is unreadable"

    report = await ObjectRetention(store).sweep(
        now=datetime.now(UTC), keep=timedelta(days=30), windows=timedelta(hours=24), limit=10
    )
    assert report.archived == BLOCKS - audit_archive.KEEP_BLOCKS
    [archive] = await audit_archive.archives(store, "wt")
    held = audit_archive.decode((await store.get(archive.key)).data)
    assert held is not None and held[2] == tampered  # the evidence, byte for byte
    assert await log.verify() == before


async def test_an_archive_holding_a_string_no_block_encodes_to_is_unreadable(
    store: ObjectStore,
) -> None:
    log = await written(store, "wu")
    await audit_archive.compact(store, "wu")
    [archive] = await audit_archive.archives(store, "wu")
    forged = zlib.compress(json.dumps(["\ud800"]).encode())  # a lone surrogate
    await store.delete(archive.key)
    await store.put(archive.key, forged)
    check = await log.verify()
    assert not check.ok and check.why == "an archive is unreadable"


async def test_a_stray_key_under_a_streams_prefix_stops_no_compaction(
    store: ObjectStore,
) -> None:
    """A key under a stream's prefix that names no block (a store's folder marker, a
    stray object) raised ValueError at every compaction of the stream after its first
    archive: retention's pass runs the compaction first, so it stopped every pass."""
    log = await written(store, "wx")
    assert await audit_archive.compact(store, "wx") == BLOCKS - audit_archive.KEEP_BLOCKS
    await store.put(keys.audit_prefix("wx") + "notes", b"not a block")
    assert await audit_archive.compact(store, "wx") == 0
    assert (await store.get(keys.audit_prefix("wx") + "notes")).data == b"not a block"
    assert (await log.verify()).records == BLOCKS


async def test_a_stream_whose_compaction_fails_stops_neither_the_others_nor_the_pass(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stream's error raised out of ``sweep_audit``, and so out of every retention
    pass: no ended session was deleted again while that stream stayed as it was."""
    await written(store, "wb")
    await written(store, "wc")
    compact = audit_archive.compact

    async def failing(on: ObjectStore, stream: str, *, quiet_before: datetime | None) -> int:
        if stream == "wb":
            raise OSError("the disk said no")
        return await compact(on, stream, quiet_before=quiet_before)

    monkeypatch.setattr(audit_archive, "compact", failing)
    retention = ObjectRetention(store)
    report = await retention.sweep(
        now=datetime.now(UTC), keep=timedelta(days=30), windows=timedelta(days=1), limit=10
    )
    assert report.archived == BLOCKS - audit_archive.KEEP_BLOCKS  # the other stream's
    assert len(report.errors) == 1 and "wb" in report.errors[0] and "OSError" in report.errors[0]


@pytest.mark.parametrize("archived", [False, True], ids=["blocks-only", "after-an-archive"])
async def test_a_stray_key_under_a_streams_prefix_is_no_missing_block(
    store: ObjectStore, archived: bool
) -> None:
    """Compaction leaves a key that names no block alone; ``verify`` took it for the next
    block and reported the chain broken ("a block is missing") though every block was
    there, and so did every verify after. A block really missing still shows: the next
    numbered key is not the one expected."""
    log = await written(store, "ws")
    if archived:
        assert await audit_archive.compact(store, "ws") > 0
    await store.put(keys.audit_prefix("ws") + "notes", b"not a block")
    check = await log.verify()
    assert check.ok and check.records == BLOCKS, check
    await store.delete(keys.audit_record("ws", BLOCKS - 1))
    assert not (await log.verify()).ok


async def quiet_stream(store: ObjectStore, stream: str, *, at: datetime) -> ObjectAudit:
    """A writer that wrote three blocks (each record stamped ``at``) and closed: a
    process that lived an hour."""
    log = ObjectAudit(store, writer=stream, key="k" * 32, checkpoint_every=2)
    for i in range(3):
        await log.append(**{**fields(i), "at": at})
    await log.close()
    return log


async def test_a_quiet_stream_is_compacted_whole_however_few_its_blocks(
    store: ObjectStore,
) -> None:
    """Each writer process has a stream of its own: one that wrote fewer blocks than
    ``MIN_BLOCKS`` and ``KEEP_BLOCKS`` together (a replica that lived an hour, a restart)
    was never compacted, its blocks loose in the store for ever, one set a process."""
    at = datetime.now(UTC) - timedelta(days=2)
    log = await quiet_stream(store, "wq", at=at)
    report = await ObjectRetention(store).sweep(
        now=at + timedelta(days=2), keep=timedelta(days=30), windows=timedelta(days=1), limit=10
    )
    assert report.archived == 3 and report.errors == []
    assert await blocks(store, "wq") == []
    [archive] = await audit_archive.archives(store, "wq")
    assert (archive.first, archive.last) == (1, 3)
    check = await log.verify()
    assert check.ok and check.records == 3 and check.checkpoints == "signed"
    await log.append(**fields(9))  # a writer that was only quiet goes on after it
    assert (await log.verify()).records == 4


async def test_a_stream_written_within_the_day_keeps_its_newest_blocks(
    store: ObjectStore,
) -> None:
    at = datetime.now(UTC)
    await quiet_stream(store, "wr", at=at)
    report = await ObjectRetention(store).sweep(
        now=at + timedelta(hours=23), keep=timedelta(days=30), windows=timedelta(days=1), limit=10
    )
    assert report.archived == 0
    assert len(await blocks(store, "wr")) == 3
