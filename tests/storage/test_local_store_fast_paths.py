"""The local folder store's fast paths: creates waiting together go to one worker thread
(one winner per key still), small objects are read on the caller's thread, a create
that need not be flushed is made at once, without an fsync, and a write with nothing
else in flight is made on the caller's thread unless its key's lock is held elsewhere or
flushes have been slow."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

import storage.local_store as local_store
from storage import blanks, keys, local_fs, local_io, wal
from storage.local_store import (
    INLINE_BURST_S,
    INLINE_FLUSH_BUDGET_S,
    INLINE_LIST_ENTRIES,
    INLINE_READ_BYTES,
    INLINE_SHARE,
    LocalObjectStore,
)
from storage.snapshots import ObjectSnapshots, ended_day
from tests.conftest import eventually
from tests.storage.conftest import refills_done
from tests.support.factories import NOW, snapshot
from torpor.errors import EtagMismatch, ObjectExists, StorageUnavailable
from torpor.lifecycle import SessionState, transition
from torpor.ports import ListPage, Staged

pytestmark = pytest.mark.timeout(30)


def leftovers(store: LocalObjectStore) -> list[Path]:
    """Files in the store's ``.tmp`` folder that it does not account for: neither the
    empty ones it keeps ready for the next writes nor the old files of objects it keeps
    to recycle (``storage.blanks``)."""
    refills_done(store)
    made = store._blanks
    ours = {*made._ready, *store._blank_folders._ready} | {e[2] for e in made._cooling}
    return [p for p in (store.root / ".tmp").iterdir() if str(p) not in ours]


def batches_of(store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every batch of creates the store hands to its worker thread."""
    batches: list[int] = []
    create_all = store._create_all

    def counted(items: list[tuple[str, bytes]], wait: bool = True) -> list[str | Exception]:
        batches.append(len(items))
        return create_all(items, wait)

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
            store.put_if_absent("queue/s/e", b"first"),
            store.put_if_absent("queue/s/e", b"second"),
            return_exceptions=True,
        )

    first, second = asyncio.run(both())
    assert isinstance(first, str) and isinstance(second, ObjectExists)
    assert asyncio.run(store.get("queue/s/e")).data == b"first"


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
        for key in ("queue/s/a1", "queue/s/a2", "queue/s/b1", "queue/t/a1", "deep/x/y/z"):
            await store.put_if_absent(key, b"x")

    asyncio.run(fill())
    cases = [
        ("queue/s/", None, 1000),
        ("queue/s/a", None, 1000),
        ("queue/s/", "queue/s/a1", 1000),
        ("queue/s/", None, 2),
        ("queue/missing/", None, 1000),
    ]
    for prefix, start_after, limit in cases:
        inline = store._list_small(prefix, start_after, limit)
        assert inline is not None, prefix
        assert inline == store._list(prefix, start_after, limit), prefix
    assert store._list_small("queue/s/", None, 2) == ListPage(
        ["queue/s/a1", "queue/s/a2"], "queue/s/a2"
    )
    assert store._list_small("deep/", None, 1000) is None, "a folder of folders is walked"
    assert store._list_small("inbox", None, 1000) is None, "the root is walked"
    assert store._list_small("queue//s/", None, 1000) is None, "unlike any key: walked"


def test_a_large_folder_is_listed_off_the_loop(tmp_path: Path) -> None:
    store = LocalObjectStore(str(tmp_path))

    async def fill_and_list() -> int:
        await asyncio.gather(
            *(store.put_if_absent(f"big/{i:04d}", b"x") for i in range(INLINE_LIST_ENTRIES + 1))
        )
        assert store._list_small("big/", None, 1000) is None
        return len((await store.list("big/")).keys)

    assert asyncio.run(fill_and_list()) == INLINE_LIST_ENTRIES + 1


class Flushes:
    """Every flush that makes writes durable (a large object's fsync, or its log's
    fdatasync: one for all the changes logged meanwhile), by the thread that made it (the
    caller's or a worker's), and apart (``files``) the flush of each small object's
    bytes before its rename; each taking at least ``slow_s``. Once ``primed`` names the
    store, only that store's: a store of an earlier test, collected meanwhile, flushes
    its log as it goes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[int] = []
        self.files: list[int] = []
        self.slow_s = 0.0
        self.only: local_store._Inline | None = None
        real = local_store._Inline.flushed

        def recorded(
            inline: local_store._Inline, fd: int, how: Callable[[int], None] | None = None
        ) -> None:
            if self.only is None or inline is self.only:
                small_file = how is not None and "/.tmp/" in os.readlink(f"/proc/self/fd/{fd}")
                (self.files if small_file else self.threads).append(threading.get_ident())

            def slow(fd: int) -> None:
                if self.slow_s:
                    time.sleep(self.slow_s)
                (how or os.fsync)(fd)

            real(inline, fd, slow)

        monkeypatch.setattr(local_store._Inline, "flushed", recorded)


def primed(store: LocalObjectStore, flushes: Flushes) -> LocalObjectStore:
    """``store`` after its first write, with its log's next segment ready: a process's
    first durable write also makes its log (a file allocated and flushed, once), which
    the tests of where later writes run leave out; nothing of it is on record."""
    asyncio.run(store.put("primer", b"x"))
    ready = eventually(
        lambda: not store._log._preparing and store._log._spare is not None,
        timeout_s=10.0,
        interval_s=0.01,
        what="the log's next segment is made ready",
    )
    asyncio.run(ready)
    store._inline.__init__()  # type: ignore[misc]
    flushes.threads.clear()
    flushes.only = store._inline
    return store


@pytest.fixture
def flushes(monkeypatch: pytest.MonkeyPatch) -> Flushes:
    # Files made ahead in a worker thread compete with the write for the disk: the
    # tests of where a write runs make none (``test_a_write_takes_a_file_made_ahead``).
    monkeypatch.setattr(blanks, "HIGH", 0)
    return Flushes(monkeypatch)


def test_a_create_that_need_not_be_durable_skips_the_logs_flush_and_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(str(tmp_path))
    flushes = Flushes(monkeypatch)
    flushes.only = store._inline
    synced = flushes.threads
    batches = batches_of(store, monkeypatch)

    async def both() -> None:
        await store.put_if_absent("queue/s/e", b"event")  # flushed, as every create
        assert (len(synced), len(flushes.files), batches) == (1, 1, [1])
        # Neither logged (nor so flushed with the log) nor queued behind the creates in
        # flight (their flushes); its own bytes are flushed before it is linked.
        await store.put_if_absent("accepted/h/d", b"accepted", durable=False)
        assert (len(synced), len(flushes.files), batches) == (1, 2, [1])

    asyncio.run(both())
    # Another process sees it at once (no cache of ours): a fresh store on the folder.
    assert asyncio.run(LocalObjectStore(str(tmp_path)).get("accepted/h/d")).data == b"accepted"
    assert not leftovers(store), "no temporary file is left behind"


def test_a_write_alone_is_made_on_the_callers_thread(
    tmp_path: Path, flushes: Flushes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each new file and folder is an inode allocated on the caller's thread, up to a few
    # ms each on a busy disk: the loop's share is another test's (the bucket's) concern,
    # and so is a slow disk's: slow fsyncs in a loaded CI run sent the next writes to a
    # worker thread, as they should (``test_a_slow_flush_sends_the_next_writes_off_...``).
    monkeypatch.setattr(local_io, "INLINE_BURST_S", 1.0)
    monkeypatch.setattr(local_io, "INLINE_FLUSH_BUDGET_S", 1.0)
    store = primed(LocalObjectStore(str(tmp_path)), flushes)

    async def one_of_each() -> None:
        etag = await store.put_if_absent("queue/s/e", b"event")
        etag = await store.put_if_match("queue/s/e", b"event 2", etag=etag)
        await store.put("sessions/s", b"snapshot")
        await store.delete("queue/s/e")

    asyncio.run(one_of_each())
    # One flush each, the delete's included (it is logged too), on the caller's thread.
    assert flushes.threads == [threading.get_ident()] * 4, "every flush on the caller's thread"
    assert asyncio.run(store.get("sessions/s")).data == b"snapshot"
    assert not asyncio.run(store.list("queue/")).keys


def test_writes_come_back_to_the_callers_thread_once_flushes_are_quick_again(
    tmp_path: Path, flushes: Flushes
) -> None:
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    threads = flushes.threads
    flushes.slow_s = 5 * INLINE_FLUSH_BUDGET_S

    async def writes() -> int:
        for i in range(4):
            await store.put_if_absent(f"a/{i}", b"x")
        flushes.slow_s = 0.0
        quick = 0
        for attempt in range(5):
            while store._inline.flush_s >= INLINE_FLUSH_BUDGET_S:  # quick flushes, off the loop
                await store.put("b/1", b"x")
                quick += 1
            threads.clear()
            await store.put(f"b/{attempt}/2", b"x")
            await store.put_if_absent(f"b/{attempt}/3", b"x")
            # A real flush slower than the budget on a loaded machine (each write flushes
            # its file and the log) sends the next write off the loop again, as it should.
            if threads == [loop_thread] * 2:
                break
        return quick

    loop_thread = threading.get_ident()
    assert asyncio.run(asyncio.wait_for(writes(), timeout=20)) < 20
    assert threads == [loop_thread] * 2, "quick again: back on the caller's thread"


def test_a_slow_flush_sends_the_next_writes_off_the_loop(tmp_path: Path, flushes: Flushes) -> None:
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    threads = flushes.threads
    flushes.slow_s = 5 * INLINE_FLUSH_BUDGET_S

    async def writes() -> None:
        await store.put_if_absent("a/0", b"x")  # nothing known yet: on the caller's thread
        await store.put_if_absent("a/1", b"x")
        await store.put_if_match("a/1", b"y", etag=local_store.etag_of(b"x"))
        await store.delete("a/0")

    loop_thread = threading.get_ident()
    asyncio.run(writes())
    assert threads[0] == loop_thread
    assert loop_thread not in threads[1:], "after a slow flush, every write off the loop"


def test_a_write_whose_key_is_locked_elsewhere_waits_off_the_loop(tmp_path: Path) -> None:
    """Another process holds the key's lock (a writer mid-flush): the write waits for it
    in a worker thread while the loop serves on; blocking the loop would deadlock here,
    since the loop itself gives the lock back."""
    store = LocalObjectStore(str(tmp_path))
    asyncio.run(store.put("k/held", b"old"))
    held = os.open(store._locks.path("k/held"), os.O_RDWR)  # another open file: another holder
    fcntl.flock(held, fcntl.LOCK_EX)

    async def contended() -> None:
        write = asyncio.ensure_future(store.put_if_match("k/held", b"new", etag=etag_old))
        deadline = time.monotonic() + 5
        while not store._inline.in_flight:  # until the write is in a worker thread
            assert time.monotonic() < deadline, "the write never left the loop"
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the loop runs on while the write waits for the lock
        assert not write.done()
        fcntl.flock(held, fcntl.LOCK_UN)
        await asyncio.wait_for(write, timeout=5)

    etag_old = local_store.etag_of(b"old")
    try:
        asyncio.run(asyncio.wait_for(contended(), timeout=10))
    finally:
        os.close(held)
    assert asyncio.run(store.get("k/held")).data == b"new"
    assert not leftovers(store), "no temporary file is left behind"


def test_writes_on_the_callers_thread_take_at_most_their_share_of_its_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flushes: Flushes
) -> None:
    """Back to back, as under load: after a burst, writes go to the worker threads (the
    loop serves other requests while they flush) and come back as the bucket drains."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    threads = flushes.threads
    flush_s = flushes.slow_s = INLINE_BURST_S / 4  # inline-quick, yet long enough to count
    monkeypatch.setattr(local_io, "INLINE_FLUSH_BUDGET_S", 1.0)

    async def back_to_back() -> float:
        started = time.perf_counter()
        for i in range(40):
            await store.put_if_absent(f"a/{i}", b"x")
        return time.perf_counter() - started

    loop_thread = threading.get_ident()
    elapsed = asyncio.run(back_to_back())
    inline = sum(t == loop_thread for t in threads) * flush_s
    assert 0 < inline <= INLINE_BURST_S + 2 * flush_s + INLINE_SHARE * elapsed, (inline, elapsed)
    assert any(t != loop_thread for t in threads), "past its share: off the loop"


@pytest.mark.parametrize("inline", [True, False], ids=["on-the-callers-thread", "in-a-worker"])
def test_a_create_whose_write_fails_whole_fails_its_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """Not a hang: the caller hears of a failure of the whole write, wherever it ran."""
    store = LocalObjectStore(str(tmp_path))
    if not inline:
        monkeypatch.setattr(local_io, "INLINE_FLUSH_BUDGET_S", -1.0)

    def broken(items: list[tuple[str, bytes]], wait: bool = True) -> list[str | Exception]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store, "_create_all", broken)
    with pytest.raises(StorageUnavailable):
        asyncio.run(asyncio.wait_for(store.put_if_absent("queue/s/e", b"x"), timeout=5))


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "link-then-unlink"])
def test_a_create_has_one_winner_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool
) -> None:
    """Whether the kernel moves the file into place with RENAME_NOREPLACE or (lacking
    it) the store links then unlinks it: create-only, and nothing left in ``.tmp``."""
    if not renameat2:
        monkeypatch.setattr(local_fs, "_libc", [None])
    store = LocalObjectStore(str(tmp_path))

    async def creates() -> list[object]:
        first = await store.put_if_absent("k/a", b"first")
        again = await asyncio.gather(store.put_if_absent("k/a", b"second"), return_exceptions=True)
        now = store._create_now("k/b", b"now")
        return [first, *again, now]

    first, second, now = asyncio.run(creates())
    assert isinstance(first, str) and isinstance(second, ObjectExists) and isinstance(now, str)
    with pytest.raises(ObjectExists):
        store._create_now("k/b", b"later")
    assert asyncio.run(store.get("k/a")).data == b"first"
    assert asyncio.run(store.get("k/b")).data == b"now"
    assert not leftovers(store), "no temporary file is left behind"


def test_a_write_takes_a_file_made_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the store has empty files and folders ready, a write creates no file and no
    folder on the caller's thread: it fills one of those files and renames it, and the
    folder, into place."""
    store = LocalObjectStore(str(tmp_path))
    asyncio.run(store.put("k/first", b"x"))  # the first write starts making them
    asyncio.run(store.put("queue/first-session/e1", b"x"))
    made = (store._blanks, store._blank_folders)
    done = eventually(
        lambda: not any(m._making or len(m._ready) < blanks.LOW for m in made),
        timeout_s=10.0,
        interval_s=0.01,
        what="files and folders are made ahead",
    )
    asyncio.run(done)
    ready = len(store._blanks._ready)
    created: list[str] = []
    real_open = os.open

    caller = threading.get_ident()  # the store's worker threads may create what they like
    real_mkdir = os.mkdir

    def recorded(path: str, flags: int, *args: object, **kwargs: object) -> int:
        if flags & os.O_CREAT and "/.tmp/" in str(path) and threading.get_ident() == caller:
            created.append(str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def mkdir(path: str, *args: object, **kwargs: object) -> None:
        if threading.get_ident() == caller:
            created.append(str(path))
        else:
            real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(blanks, "HIGH", 0)  # none made meanwhile
    monkeypatch.setattr(os, "open", recorded)
    monkeypatch.setattr(os, "mkdir", mkdir)

    async def writes() -> None:
        etag = await store.put_if_absent("k/a", b"created")
        await store.put_if_match("k/a", b"swapped", etag=etag)
        await store.put("k/b", b"put")
        await store.put("queue/new-session/e1", b"in a new folder")

    asyncio.run(writes())
    assert created == [], "no file or folder created on the write's path"
    assert asyncio.run(store.get("queue/new-session/e1")).data == b"in a new folder"
    assert asyncio.run(store.get("k/a")).data == b"swapped"
    assert len(store._blanks._ready) == ready - 4
    asyncio.run(store.close())
    assert not list((tmp_path / ".tmp").iterdir()), "closed: the files made ahead are removed"


def test_a_staged_create_is_visible_at_once_and_durable_with_the_next_flush(
    tmp_path: Path, flushes: Flushes
) -> None:
    """An inbox event staged, then its audit record created: the event is in place (a
    second create of it loses) before any flush, and the audit record's one flush of
    the log makes both durable; the event's ``durable()`` then costs no flush."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)

    async def staged_then_created() -> None:
        staged = await store.stage_if_absent("queue/s/e", b"event")
        assert flushes.threads == [], "staged: nothing flushed yet"
        assert (await LocalObjectStore(str(tmp_path)).get("queue/s/e")).data == b"event"
        with pytest.raises(ObjectExists):
            await store.stage_if_absent("queue/s/e", b"again")
        await store.put_if_absent("records/w/1", b"record")
        assert len(flushes.threads) == 1
        await staged.durable()
        assert len(flushes.threads) == 1, "the record's flush covered the staged event"

    asyncio.run(staged_then_created())
    assert asyncio.run(store.get("queue/s/e")).data == b"event"
    assert not leftovers(store), "no temporary file is left behind"


def test_a_staged_create_alone_is_flushed_when_awaited(tmp_path: Path, flushes: Flushes) -> None:
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    logged = store._log

    async def alone() -> None:
        staged = await store.stage_if_absent("queue/s/e", b"event")
        ticket = logged._appended
        assert not logged.synced(ticket)
        await staged.durable()
        assert logged.synced(ticket) and len(flushes.threads) == 1

    asyncio.run(alone())


def test_a_staged_create_whose_key_is_locked_elsewhere_is_made_durable_off_the_loop(
    tmp_path: Path, flushes: Flushes
) -> None:
    """Another process holds the key's stripe: the create waits for it in a worker
    thread, as ``put_if_absent``, and returns durable."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    held = os.open(store._locks.path("queue/s/e"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)

    async def contended() -> None:
        staged = asyncio.ensure_future(store.stage_if_absent("queue/s/e", b"event"))
        await eventually(lambda: store._inline.in_flight > 0, what="the create leaves the loop")
        assert not staged.done()
        fcntl.flock(held, fcntl.LOCK_UN)
        result = await asyncio.wait_for(staged, timeout=5)
        assert len(flushes.threads) == 1 and flushes.threads[0] != threading.get_ident()
        await result.durable()
        assert len(flushes.threads) == 1

    try:
        asyncio.run(asyncio.wait_for(contended(), timeout=10))
    finally:
        os.close(held)
    assert asyncio.run(store.get("queue/s/e")).data == b"event"


def test_a_staged_replace_is_visible_at_once_and_durable_with_the_next_flush(
    tmp_path: Path, flushes: Flushes
) -> None:
    """``stage_if_match``: the new object is in place before any flush (a swap on the
    old etag now loses), a later write's flush covers it, and alone its ``durable()``
    flushes."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    logged = store._log

    async def staged_then_written() -> None:
        etag = await store.put_if_absent("sessions/s", b"v1")
        flushes.threads.clear()
        staged = await store.stage_if_match("sessions/s", b"v2", etag=etag)
        ticket = logged._appended
        assert flushes.threads == [] and not logged.synced(ticket), "staged: not flushed"
        assert (await LocalObjectStore(str(tmp_path)).get("sessions/s")).data == b"v2"
        with pytest.raises(EtagMismatch):
            await store.stage_if_match("sessions/s", b"lost", etag=etag)
        await store.put("markers/s", b"")
        assert len(flushes.threads) == 1
        await staged.durable()
        assert len(flushes.threads) == 1, "the marker's flush covered the staged snapshot"
        again = await store.stage_if_match("sessions/s", b"v3", etag=staged.etag)
        await again.durable()
        assert len(flushes.threads) == 2 and logged.synced(logged._appended), "alone: flushed"

    asyncio.run(staged_then_written())
    assert asyncio.run(store.get("sessions/s")).data == b"v3"
    assert not leftovers(store), "no temporary file is left behind"


def test_a_sessions_last_commit_is_one_flush_for_its_snapshot_and_its_marker(
    tmp_path: Path, flushes: Flushes
) -> None:
    """The terminal snapshot is staged and the live marker's move flushes both: one
    flush where there were two (the snapshot's, then the move's)."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    snapshots = ObjectSnapshots(store)

    async def last_commit() -> str:
        first = await snapshots.create(snapshot())
        running = await snapshots.save(
            transition(first, SessionState.RUNNING, now=NOW), expected_generation=0
        )
        flushes.threads.clear()
        await snapshots.save(
            transition(running, SessionState.COMPLETED, now=NOW), expected_generation=1
        )
        assert len(flushes.threads) == 1, "one flush for the snapshot and the marker"
        assert store._log.synced(store._log._appended)
        return first.session_id

    sid = asyncio.run(last_commit())
    fresh = LocalObjectStore(str(tmp_path))
    loaded = asyncio.run(ObjectSnapshots(fresh).load(sid))
    assert loaded.state is SessionState.COMPLETED and loaded.generation == 2
    assert asyncio.run(fresh.list(keys.live(sid))).keys == []
    assert asyncio.run(fresh.get(keys.ended(ended_day(loaded.updated_at), sid))).data == b""


def test_a_last_commit_whose_marker_move_fails_is_still_made_durable(
    tmp_path: Path, flushes: Flushes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move fails before it flushes: the commit reports its error, but only after a
    flush of its own made the terminal snapshot durable, and the live marker stays (the
    full repair finishes the move, ``list_live``)."""
    store = primed(LocalObjectStore(str(tmp_path)), flushes)
    snapshots = ObjectSnapshots(store)

    async def failing_move(key: str, to: str, **_: object) -> bool:
        raise StorageUnavailable("the disk went away mid-move")

    async def last_commit() -> str:
        first = await snapshots.create(snapshot())
        flushes.threads.clear()
        monkeypatch.setattr(store, "move", failing_move)
        with pytest.raises(StorageUnavailable):
            await snapshots.save(
                transition(first, SessionState.FAILED, now=NOW), expected_generation=0
            )
        assert len(flushes.threads) == 1 and store._log.synced(store._log._appended)
        return first.session_id

    sid = asyncio.run(last_commit())
    fresh = LocalObjectStore(str(tmp_path))
    assert asyncio.run(ObjectSnapshots(fresh).load(sid)).state is SessionState.FAILED
    assert asyncio.run(fresh.list(keys.live(sid))).keys == [keys.live(sid)]


def logs(root: Path) -> list[list[tuple[wal.Op, str]]]:
    """What each log segment in the store holds, in order (one a checkpoint removed
    meanwhile is left out)."""
    out = []
    for path in sorted((root / ".wal").glob("*.log")):
        try:
            out.append([(r.op, r.key) for r in wal.decode(path.read_bytes())])
        except FileNotFoundError:
            continue
    return out


async def collect(items: AsyncIterator[object]) -> list[object]:
    return [item async for item in items]


def test_a_last_commit_whose_snapshot_another_writers_flush_lost_keeps_its_live_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The terminal snapshot is staged; another writer's flush covers it and fails (the
    log loses it for good); the marker's move would flush fine on its own, but the live
    marker must not go, nor its removal be logged: after a power cut the snapshot may
    read as before, and a session with neither marker is one repair never finds. The
    commit fails; the live walk (repair) finishes the move once the disk works."""
    store = LocalObjectStore(str(tmp_path))
    snapshots = ObjectSnapshots(store)
    real_flush = store._log._flush
    failures: list[OSError] = []

    def flaky(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_flush(fd)

    real_stage = store.stage_if_match

    async def stage_then_another_write_fails(key: str, data: bytes, *, etag: str) -> Staged:
        staged = await real_stage(key, data, etag=etag)
        failures.append(OSError(errno.EIO, "Input/output error"))
        with pytest.raises(StorageUnavailable):
            await store.put("queue/other/e", b"its flush covers the snapshot, and fails")
        return staged

    async def last_commit() -> str:
        first = await snapshots.create(snapshot())
        store._log._flush = flaky
        monkeypatch.setattr(store, "stage_if_match", stage_then_another_write_fails)
        with pytest.raises(StorageUnavailable):
            await snapshots.save(
                transition(first, SessionState.FAILED, now=NOW), expected_generation=0
            )
        return first.session_id

    sid = asyncio.run(last_commit())
    assert asyncio.run(store.list(keys.live(sid))).keys == [keys.live(sid)]
    removals = [key for records in logs(tmp_path) for op, key in records if op is wal.Op.DELETE]
    assert keys.live(sid) not in removals, "the live marker's removal was logged"
    monkeypatch.undo()
    # The live walk (repair, here in a store of another process) finishes the move, but
    # only resting on the terminal snapshot written again: its own record was lost, and
    # its file may be on disk as it was before.
    fresh = LocalObjectStore(str(tmp_path))
    live = asyncio.run(collect(ObjectSnapshots(fresh).list_live(now=NOW)))
    assert live == [] and asyncio.run(fresh.list(keys.live(sid))).keys == []
    removal_of = (wal.Op.DELETE, keys.live(sid))
    (logged,) = [records for records in logs(tmp_path) if removal_of in records]
    removal = logged.index(removal_of)
    assert (wal.Op.PUT, keys.snapshot(sid)) in logged[:removal], logged
    assert asyncio.run(ObjectSnapshots(fresh).load(sid)).state is SessionState.FAILED


def test_a_move_to_a_free_key_links_the_object_there_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's marker moved to a key that holds nothing is linked there directly:
    no name in ``.tmp`` renamed over it (a second folder's lock and a rename across
    folders, on every session's last commit); a key that holds an object still has it
    replaced in one step (``test_write_ahead_log.py::test_a_moved_object_survives_...``)."""
    store = LocalObjectStore(str(tmp_path))
    asyncio.run(store.put("live/s", b""))
    target = store._file("ended/d/s")
    renamed: list[str] = []
    real_replace, real_rename = os.replace, os.rename

    def replace(src: str, dst: str, **kw: object) -> None:
        renamed.append(str(dst))
        real_replace(src, dst, **kw)

    def rename(src: str, dst: str, **kw: object) -> None:
        renamed.append(str(dst))
        real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    assert asyncio.run(store.move("live/s", "ended/d/s")) is True
    assert target not in renamed, "linked at its key, not renamed over it"
    monkeypatch.undo()
    assert asyncio.run(store.get("ended/d/s")).data == b""
    assert asyncio.run(store.list("live/")).keys == []
    assert not leftovers(store), "no temporary name is left behind"


@pytest.mark.parametrize("inline", [True, False])
def test_the_loops_a_store_outlived_are_not_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """A store outlives the loops that used it (tests, scripts, ``blocking``): its
    creates' batchers and its rows' flushes were kept by loop weakly, but the finished
    task or future kept there holds its loop, so each loop stayed for the store's life."""
    store = LocalObjectStore(tmp_path)
    if not inline:  # creates and the rows' flush off the loop, as under load
        monkeypatch.setattr(store._inline, "allows", lambda size: False)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def go(n: int) -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await store.put_if_absent(f"queue/{n}", b"file")
        await asyncio.gather(*(store.put_if_absent(f"inbox/{n}-{i}", b"row") for i in range(3)))

    for n in range(3):
        asyncio.run(go(n))
    # The worker thread that ran the last loop's flush may still be on its way out of it
    # (a loaded CI machine: the last loop was held for that moment); held for the store's
    # life is what fails, so the loops are looked at until they are let go, 5 s at most.
    deadline = time.monotonic() + 5
    while any(ref() is not None for ref in loops) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert [ref() for ref in loops] == [None, None, None]


@pytest.mark.parametrize("size", [0, 1, 4096, 70_000, 300_000])
def test_a_files_contents_are_read_whole(tmp_path: Path, size: int) -> None:
    from storage.local_files import _contents

    path = tmp_path / "object"
    path.write_bytes(os.urandom(size))
    assert _contents(str(path)) == path.read_bytes()


def test_a_file_that_grew_since_its_size_was_read_is_read_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size read first is a hint: bytes past it (the file grew in between) are read on
    to the end, not cut off at the size seen."""
    from storage import local_files

    path = tmp_path / "object"
    data = os.urandom(200_000)
    path.write_bytes(data)
    fstat = os.fstat

    class Smaller:
        def __init__(self, fd: int) -> None:
            self.st_size = fstat(fd).st_size // 3  # as it was before it grew

    monkeypatch.setattr(local_files.os, "fstat", Smaller)
    assert local_files._contents(str(path)) == data


def test_a_folder_or_nothing_where_a_file_was_is_no_object(tmp_path: Path) -> None:
    from storage.local_files import _contents
    from storage.local_fs import _NO_OBJECT

    for where in (tmp_path, tmp_path / "gone", tmp_path / "gone" / "deeper"):
        with pytest.raises(_NO_OBJECT):
            _contents(str(where))


def test_a_read_the_kernel_cut_short_is_read_on_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux returns at most 2 GiB less a page from one read: a bigger object comes back
    in parts, and every part is read (here the cap is made 4 KiB)."""
    from storage import local_files

    path = tmp_path / "object"
    data = os.urandom(50_000)
    path.write_bytes(data)
    read = os.read
    monkeypatch.setattr(local_files.os, "read", lambda fd, n: read(fd, min(n, 4096)))
    assert local_files._contents(str(path)) == data
