"""The local folder store's fast paths: creates waiting together go to one worker thread
(one winner per key still), small objects are read on the caller's thread, and a create
that need not be flushed is made at once, without an fsync."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from storage.local_store import INLINE_LIST_ENTRIES, INLINE_READ_BYTES, LocalObjectStore
from torpor.errors import ObjectExists
from torpor.ports import ListPage

pytestmark = pytest.mark.timeout(30)


def batches_of(store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch of creates the store hands to its worker thread."""
    batches: list[int] = []
    create_all = store._create_all

    def counted(items: list[tuple[str, bytes]]) -> list[str | Exception]:
        batches.append(len(items))
        return create_all(items)

    monkeypatch.setattr(store, "_create_all", counted)
    return batches


def test_creates_waiting_together_take_one_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(str(tmp_path))
    batches = batches_of(store, monkeypatch)

    async def burst() -> list[str]:
        return await asyncio.gather(*(store.put_if_absent(f"k/{i}", b"x") for i in range(32)))

    etags = asyncio.run(burst())
    assert len(etags) == 32 and sum(batches) == 32
    assert len(batches) < 32, f"32 creates at once took {len(batches)} thread hops"


def test_creates_of_one_key_in_one_batch_have_one_winner(tmp_path: Path) -> None:
    store = LocalObjectStore(str(tmp_path))

    async def both() -> list[object]:
        return await asyncio.gather(
            store.put_if_absent("inbox/s/e", b"first"),
            store.put_if_absent("inbox/s/e", b"second"),
            return_exceptions=True,
        )

    first, second = asyncio.run(both())
    assert isinstance(first, str) and isinstance(second, ObjectExists)
    assert asyncio.run(store.get("inbox/s/e")).data == b"first"


def test_small_objects_are_read_inline_and_large_ones_whole(tmp_path: Path) -> None:
    store = LocalObjectStore(str(tmp_path))
    small, large = b"s" * 100, bytes(range(256)) * (INLINE_READ_BYTES // 128)

    async def round_trip() -> tuple[bytes, bytes, str]:
        etag = await store.put_if_absent("a/large", large)
        await store.put_if_absent("a/small", small)
        assert store._read_small("a/large") is None, "a large object goes to a thread"
        inline = store._read_small("a/small")
        assert inline is not None and inline.data == small
        got = await store.get("a/large")
        assert got.etag == etag
        return got.data, (await store.get("a/small")).data, etag

    got_large, got_small, _ = asyncio.run(round_trip())
    assert (got_large, got_small) == (large, small)


def test_a_create_right_after_another_is_written(tmp_path: Path) -> None:
    """The caller of one create runs before its batch's task is cleaned up: the next
    create must still get a batch of its own, not wait on the finished one forever."""
    store = LocalObjectStore(str(tmp_path))

    async def one_after_another() -> None:
        for i in range(3):
            await store.put_if_absent(f"seq/{i}", b"x")  # awaited directly: no task between

    asyncio.run(asyncio.wait_for(one_after_another(), timeout=5))


def test_small_flat_folders_are_listed_inline_exactly_as_walked(tmp_path: Path) -> None:
    store = LocalObjectStore(str(tmp_path))

    async def fill() -> None:
        for key in ("inbox/s/a1", "inbox/s/a2", "inbox/s/b1", "inbox/t/a1", "deep/x/y/z"):
            await store.put_if_absent(key, b"x")

    asyncio.run(fill())
    cases = [
        ("inbox/s/", None, 1000),
        ("inbox/s/a", None, 1000),
        ("inbox/s/", "inbox/s/a1", 1000),
        ("inbox/s/", None, 2),
        ("inbox/missing/", None, 1000),
    ]
    for prefix, start_after, limit in cases:
        inline = store._list_small(prefix, start_after, limit)
        assert inline is not None, prefix
        assert inline == store._list(prefix, start_after, limit), prefix
    assert store._list_small("inbox/s/", None, 2) == ListPage(
        ["inbox/s/a1", "inbox/s/a2"], "inbox/s/a2"
    )
    assert store._list_small("deep/", None, 1000) is None, "a folder of folders is walked"
    assert store._list_small("inbox", None, 1000) is None, "the root is walked"
    assert store._list_small("inbox//s/", None, 1000) is None, "unlike any key: walked"


def test_a_large_folder_is_listed_off_the_loop(tmp_path: Path) -> None:
    store = LocalObjectStore(str(tmp_path))

    async def fill_and_list() -> int:
        await asyncio.gather(
            *(store.put_if_absent(f"big/{i:04d}", b"x") for i in range(INLINE_LIST_ENTRIES + 1))
        )
        assert store._list_small("big/", None, 1000) is None
        return len((await store.list("big/")).keys)

    assert asyncio.run(fill_and_list()) == INLINE_LIST_ENTRIES + 1


def test_a_create_that_need_not_be_flushed_skips_the_fsync_and_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(str(tmp_path))
    synced: list[int] = []
    real_fsync = os.fsync

    def counted(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    batches = batches_of(store, monkeypatch)

    async def both() -> None:
        await store.put_if_absent("inbox/s/e", b"event")  # flushed, as every create
        assert (len(synced), batches) == (1, [1])
        # Neither flushed nor queued behind the creates in flight (their fsyncs).
        await store.put_if_absent("accepted/h/d", b"accepted", durable=False)
        assert (len(synced), batches) == (1, [1])

    asyncio.run(both())
    # Another process sees it at once (no cache of ours): a fresh store on the folder.
    assert asyncio.run(LocalObjectStore(str(tmp_path)).get("accepted/h/d")).data == b"accepted"
    assert not list((tmp_path / ".tmp").iterdir()), "no temporary file is left behind"
