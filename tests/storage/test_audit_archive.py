"""Audit compaction: old blocks become one archive, and the chain still verifies, still
shows a cut, and survives a compaction that stopped half way."""

from __future__ import annotations

import pytest

from storage import audit_archive, keys
from storage.audit import ObjectAudit
from storage.local_store import LocalObjectStore
from storage.retention import ObjectRetention
from tests.storage.test_audit import fields
from torpor.ports import ObjectStore

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
