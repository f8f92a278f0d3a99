"""Group commit of the local folder store: writers waiting together share one flush, and
no writer is released by a flush that started before it arrived (its bytes might not be
in it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from storage.group_sync import GroupSync

pytestmark = pytest.mark.timeout(30)


class Held:
    """A flush (``syncfs``) or ``fsync`` stand-in the test holds until it lets it go."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.calls = 0

    def __call__(self, fd: int) -> int:
        self.calls += 1
        self.started.release()
        self.go.acquire()
        return 0


def test_writers_arriving_during_a_flush_share_the_next_one(tmp_path: Path) -> None:
    syncfs, fsync = Held(), Held()
    group = GroupSync(str(tmp_path), syncfs=syncfs, fsync=fsync)
    released: list[tuple[str, int, int]] = []

    def writer(name: str) -> None:
        group.wait(-1)
        released.append((name, fsync.calls, syncfs.calls))

    first = threading.Thread(target=writer, args=("first",))
    first.start()
    fsync.started.acquire()  # alone: the first writer fsyncs its own file
    late = [threading.Thread(target=writer, args=(f"w{i}",)) for i in range(8)]
    for t in late:
        t.start()
    while group._arrived < 9:  # every late writer is waiting (a busy wait, no sleep)
        threading.Event().wait(0.001)
    fsync.go.release()  # it covers only the first writer
    syncfs.started.acquire()  # one late writer leads a shared flush for all eight
    syncfs.go.release()
    for t in [first, *late]:
        t.join(timeout=10)
    assert (fsync.calls, syncfs.calls) == (1, 1), "eight writers waiting together: one flush"
    assert released[0] == ("first", 1, 0)
    assert all(s == 1 for name, _, s in released if name != "first"), (
        "a writer that arrived during the first sync is released only after the next"
    )


def test_a_writer_alone_fsyncs_its_own_file(tmp_path: Path) -> None:
    syncfs = Held()
    group = GroupSync(str(tmp_path), syncfs=syncfs)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    group.wait(fd)
    os.close(fd)
    assert syncfs.calls == 0, "no whole-file-system flush for a single writer"


def test_a_failed_flush_reaches_its_writer(tmp_path: Path) -> None:
    group = GroupSync(str(tmp_path), syncfs=lambda fd: -1)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    group._durable = -1  # as if another writer were waiting too: a shared flush
    with pytest.raises(OSError):
        group.wait(fd)
    os.close(fd)
    assert group.flushes == 0 and not group._running


def test_the_local_store_writes_through_one_shared_flush(tmp_path: Path) -> None:
    import asyncio

    from storage.local_store import LocalObjectStore

    store = LocalObjectStore(str(tmp_path))
    before = store._sync.flushes

    async def burst() -> None:
        await asyncio.gather(*(store.put_if_absent(f"k/{i}", b"x") for i in range(32)))

    asyncio.run(burst())
    flushes = store._sync.flushes - before
    assert store._sync._syncfs is not None, "this machine's libc has syncfs"
    assert 1 <= flushes < 32, f"32 concurrent writes took {flushes} flushes"


def test_creates_of_one_key_in_one_batch_have_one_winner(tmp_path: Path) -> None:
    import asyncio

    from storage.local_store import LocalObjectStore
    from torpor.errors import ObjectExists

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
    import asyncio

    from storage.local_store import INLINE_READ_BYTES, LocalObjectStore

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
