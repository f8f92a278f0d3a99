"""The local store's per-webhook objects as rows of one SQLite table
(``storage.small_objects``): the same create-only and compare-and-swap semantics as its
files, for every process on the host; listings that span rows and files; what an older
version left as files moved in; a writer killed after its commit; a table locked by
another process, which the caller's event loop does not wait for; and a failed flush of
the table's log, which every process of the boot refuses row writes for."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from storage import small_objects, wal
from storage.local_store import LocalObjectStore
from tests.conftest import eventually
from tests.storage.conftest import FailingOnce, killed_child
from tests.support.race import race
from torpor.errors import (
    EtagMismatch,
    InvalidKey,
    ObjectExists,
    ObjectNotFound,
    StorageUnavailable,
)
from torpor.faults import CrashPoint
from torpor.ports import Staged

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def test_which_keys_are_rows_is_fixed_by_prefix() -> None:
    assert small_objects.holds("inbox/s/e") and small_objects.holds("replays/src/d")
    assert not small_objects.holds("snapshots/s") and not small_objects.holds("inbox-x/a")
    assert small_objects.reach("inbox/s/") == (False, True)
    assert small_objects.reach("") == (True, True)
    assert small_objects.reach("in") == (True, True)
    assert small_objects.reach("snapshots/") == (True, False)


async def test_the_rows_are_not_files(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/e", b"event")
    await store.put_if_absent("replays/src/d", b"accepted", durable=False)
    assert not (LocalObjectStore.objects_in(tmp_path) / "inbox").exists()
    assert not (LocalObjectStore.objects_in(tmp_path) / "replays").exists()
    reopened = LocalObjectStore(tmp_path)
    assert (await reopened.get("inbox/s/e")).data == b"event"
    assert (await reopened.get("replays/src/d")).data == b"accepted"
    await store.close()
    await reopened.close()


async def test_rows_keep_the_stores_semantics(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    etag = await store.put_if_absent("inbox/s/e", b"one")
    assert etag == '"' + hashlib.md5(b"one").hexdigest() + '"'
    with pytest.raises(ObjectExists):
        await store.put_if_absent("inbox/s/e", b"two")
    assert (await store.get("inbox/s/e")).data == b"one"
    assert (await store.get("inbox/s/e", max_bytes=2)).data == b"on"
    assert (await store.get("inbox/s/e", max_bytes=2)).etag == etag  # the whole object's
    with pytest.raises(EtagMismatch):
        await store.put_if_match("inbox/s/e", b"x", etag='"0000"')
    with pytest.raises(EtagMismatch):
        await store.put_if_match("inbox/s/missing", b"x", etag=etag)
    new = await store.put_if_match("inbox/s/e", b"three", etag=etag)
    staged = await store.stage_if_match("inbox/s/e", b"four", etag=new)
    await staged.durable()
    assert (await store.get("inbox/s/e")).data == b"four"
    await store.put("inbox/s/e", b"five")
    assert (await store.get("inbox/s/e")).data == b"five"
    await store.delete("inbox/s/e")
    await store.delete("inbox/s/e")  # idempotent, as S3's
    with pytest.raises(ObjectNotFound):
        await store.get("inbox/s/e")
    with pytest.raises(InvalidKey):
        await store.put_if_absent("inbox/../snapshots/x", b"x")
    with pytest.raises(InvalidKey):
        await store.get("inbox//e")
    await store.close()


async def test_creates_in_one_tick_share_a_transaction_and_each_is_answered(
    tmp_path: Path,
) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/taken", b"first")
    results = await asyncio.gather(
        *(store.put_if_absent(f"inbox/s/{i:03d}", b"%d" % i) for i in range(100)),
        store.put_if_absent("inbox/s/taken", b"second"),
        store.put_if_absent("inbox/s/twice", b"a"),
        store.put_if_absent("inbox/s/twice", b"b"),
        return_exceptions=True,
    )
    assert all(isinstance(r, str) for r in results[:100])
    assert isinstance(results[100], ObjectExists)
    assert sorted(type(r).__name__ for r in results[101:]) == ["ObjectExists", "str"]
    assert (await store.get("inbox/s/taken")).data == b"first"
    assert len((await store.list("inbox/s/")).keys) == 102
    await store.close()


async def test_a_staged_row_is_visible_at_once_and_durable_when_awaited(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    other = LocalObjectStore(tmp_path)
    staged = await store.stage_if_absent("inbox/s/e", b"event")
    assert (await other.get("inbox/s/e")).data == b"event"  # before any flush
    await staged.durable()
    assert store._rows.synced >= store._rows.committed
    with pytest.raises(ObjectExists):
        await other.stage_if_absent("inbox/s/e", b"again")
    await store.close()
    await other.close()


async def test_an_inbox_event_and_its_audit_block_share_one_flush(tmp_path: Path) -> None:
    """The gateway stages the event, then writes its audit block durably: one flush of
    the table's log covers both (as files, each webhook waited for one more)."""
    store = LocalObjectStore(tmp_path)
    flushed: list[int] = []
    flush = store._rows._flush
    store._rows._flush = lambda fd: (flushed.append(fd), flush(fd))[1]
    staged = await store.stage_if_absent("inbox/s/e", b"event")
    assert flushed == []
    await store.put_if_absent("audit/w/000000000001", b"block")
    assert len(flushed) == 1
    await staged.durable()
    assert len(flushed) == 1, "the block's flush covered the event"
    await store.close()


def test_a_forked_child_uses_the_rows_through_its_own_connections(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    asyncio.run(store.put_if_absent("inbox/s/parent", b"p"))
    pid = os.fork()
    if pid == 0:  # the child: its own connections, the parent's left alone
        code = 1
        try:

            async def child() -> None:
                assert (await store.get("inbox/s/parent")).data == b"p"
                await store.put_if_absent("inbox/s/child", b"c")

            asyncio.run(child())
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert asyncio.run(store.get("inbox/s/child")).data == b"c"
    asyncio.run(store.put_if_absent("inbox/s/parent-again", b"p2"))  # the parent's still work
    asyncio.run(store.close())


@pytest.mark.parametrize("limit", [1, 2, 3, 1000])
async def test_a_listing_across_rows_and_files_is_one_sorted_paged_listing(
    tmp_path: Path, limit: int
) -> None:
    store = LocalObjectStore(tmp_path)
    names = [
        "a/1",
        "inbox-x/1",  # a file beside the rows' prefix
        "inbox/s/1",
        "inbox/s/2",
        "inbox/t/1",
        "inbox0",
        "replays/r/1",
        "snapshots/s",
        "z/9",
    ]
    for name in names:
        await store.put_if_absent(name, name.encode())
    for prefix in ("", "in", "inbox", "inbox/", "inbox/s/", "r", "replays/r/1", "zz"):
        listed, token = [], None
        while True:
            page = await store.list(prefix, start_after=token, limit=limit)
            assert len(page.keys) <= limit
            listed += page.keys
            if page.next_token is None:
                break
            token = page.next_token
        assert listed == sorted(n for n in names if n.startswith(prefix)), prefix
        walked = await store.walk(prefix, limit=10_000)
        assert walked.keys == listed and walked.next_token is None
    await store.close()


async def test_moves_between_rows_and_files(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/a", b"a")
    assert await store.move("inbox/s/a", "inbox/s/b")
    assert (await store.get("inbox/s/b")).data == b"a"
    assert not await store.move("inbox/s/a", "inbox/s/c")  # gone: nothing changed
    with pytest.raises(ObjectNotFound):
        await store.get("inbox/s/c")
    assert await store.move("inbox/s/b", "kept/b")  # a row to a file
    assert (await store.get("kept/b")).data == b"a"
    assert await store.move("kept/b", "inbox/s/d")  # and back
    assert (await store.get("inbox/s/d")).data == b"a"
    assert (await store.list("")).keys == ["inbox/s/d"]
    await store.close()


def test_rows_have_exactly_one_creator_across_processes(tmp_path: Path) -> None:
    spec = ("local", {"root": str(tmp_path / "race")})
    winners = race(spec, "put_if_absent", workers=6, rounds=20, key_prefix="inbox/race/")
    assert all(len(w) == 1 for w in winners.values()), winners


async def test_rows_compare_and_swap_has_exactly_one_winner_across_processes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "race"
    store = LocalObjectStore(root)
    etags = [await store.put_if_absent(f"inbox/race/round-{r}", b"base") for r in range(20)]
    winners = race(
        ("local", {"root": str(root)}),
        "put_if_match",
        workers=6,
        rounds=20,
        etags=list(etags),
        key_prefix="inbox/race/",
    )
    assert all(len(w) == 1 for w in winners.values()), winners
    await store.close()


CHILD = """
import asyncio, sys
from storage.local_store import LocalObjectStore

async def main(folder):
    store = LocalObjectStore(folder)
    await store.put_if_absent("inbox/s/e", b"the event")
    print("survived", flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_writer_killed_after_its_commit_leaves_the_row_for_every_process(
    tmp_path: Path,
) -> None:
    killed_child(CHILD, str(tmp_path), at=CrashPoint.STORE_ROWS_COMMITTED)

    async def after() -> None:
        store = LocalObjectStore(tmp_path)
        assert (await store.get("inbox/s/e")).data == b"the event"
        with pytest.raises(ObjectExists):  # the dead writer's create still wins
            await store.put_if_absent("inbox/s/e", b"another")
        await store.close()

    asyncio.run(after())


async def test_files_an_older_version_wrote_are_moved_in_once(tmp_path: Path) -> None:
    objects = LocalObjectStore.objects_in(tmp_path)
    old = {
        "inbox/s1/e1": b"one",
        "inbox/s1/e2": b"two",
        "inbox/s2/e1": b"three",
        "replays/src/abc": b"accepted",
    }
    for key, data in old.items():
        (objects / key).parent.mkdir(parents=True, exist_ok=True)
        (objects / key).write_bytes(data)
    (objects / "snapshots").mkdir()
    (objects / "snapshots" / "s1").write_bytes(b"snapshot")

    store = LocalObjectStore(tmp_path)
    for key, data in old.items():
        found = await store.get(key)
        assert found.data == data
        assert found.etag == '"' + hashlib.md5(data).hexdigest() + '"'
    assert (await store.list("inbox/s1/")).keys == ["inbox/s1/e1", "inbox/s1/e2"]
    assert not (objects / "inbox").exists() and not (objects / "replays").exists()
    assert (await store.get("snapshots/s1")).data == b"snapshot"  # files stay files
    with pytest.raises(ObjectExists):
        await store.put_if_absent("inbox/s1/e1", b"again")
    assert store._rows.adopt(str(objects)) == 0  # nothing left to move
    await store.close()


async def test_a_table_another_process_holds_does_not_stall_the_event_loop(
    tmp_path: Path,
) -> None:
    """Another process's write transaction (a purge, say): the create waits for it in
    a worker thread, while the loop goes on serving; then it completes."""
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/first", b"x")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"
            "db.execute('COMMIT')\n",
            str(tmp_path / ".small" / small_objects.DATABASE),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline() == b"held\n"
        create = asyncio.ensure_future(store.put_if_absent("inbox/s/second", b"y"))
        ticks, started = 0, time.monotonic()
        while time.monotonic() - started < 0.5:  # the loop keeps turning meanwhile
            await asyncio.sleep(0.01)
            ticks += 1
        assert not create.done()  # it waits for the lock, off the loop
        assert ticks >= 20
        assert (await store.get("inbox/s/first")).data == b"x"  # reads never wait
        holder.stdin.write(b"go\n")
        holder.stdin.flush()
        await asyncio.wait_for(create, timeout=30)
    finally:
        holder.kill()
        holder.communicate()
    assert (await store.get("inbox/s/second")).data == b"y"
    await store.close()


def holding_the_write_lock(path: str) -> subprocess.Popen[bytes]:
    """Another process in a write transaction on the table at ``path``: it prints
    ``held`` once it holds the lock, and ``done`` once a line (or the end) on its stdin
    has it roll back."""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE')\n"
            "print('held', flush=True)\n"
            "sys.stdin.readline()\n"
            "db.execute('ROLLBACK')\n"
            "print('done', flush=True)\n",
            path,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def test_a_callers_thread_write_behind_another_process_is_busy_and_leaves_its_connection_free(
    tmp_path: Path,
) -> None:
    """The caller's thread never waits: another process's transaction is ``Busy`` (SQLite's
    error as its cause), with the quick connection's lock released and no transaction
    left open on it, so the next write from that thread goes through once the other
    process is done."""
    rows = small_objects.SmallObjects(str(tmp_path))
    holder = holding_the_write_lock(rows.path)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(small_objects.Busy) as busy:
            rows.create([("inbox/s/first", b"x", '"e"')], wait=False)
        assert isinstance(busy.value.__cause__, sqlite3.OperationalError)
        assert holder.stdin is not None
        holder.stdin.write(b"go\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == b"done\n"
        made, _ = rows.create([("inbox/s/first", b"x", '"e"')], wait=False)
        assert made == [True]
        assert rows.get("inbox/s/first", wait=False) == (b"x", '"e"')
    finally:
        holder.kill()
        holder.communicate()
        rows.close()


def test_a_write_that_fails_inside_its_transaction_is_rolled_back_whole(tmp_path: Path) -> None:
    """A write that fails part-way leaves none of its rows and no transaction open: the
    same connection's next write commits on its own."""
    rows = small_objects.SmallObjects(str(tmp_path))
    try:
        with pytest.raises(StorageUnavailable), rows._db(False) as db, small_objects._Immediate(db):
            db.execute("INSERT INTO objects VALUES (?, ?, ?)", ("inbox/s/a", '"e"', b"x"))
            db.execute("INSERT INTO no_such_table VALUES (1)")
        assert rows.get("inbox/s/a", wait=False) is None
        made, _ = rows.create([("inbox/s/b", b"y", '"e"')], wait=False)
        assert made == [True]
        assert rows.get("inbox/s/b", wait=False) == (b"y", '"e"')
    finally:
        rows.close()


def test_writes_queued_behind_another_process_transaction_each_give_up_at_their_own_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker threads' writes share one connection, one at a time: each that waited
    out its busy timeout behind another process's transaction made the next one start a
    whole timeout of its own, so the n-th write of a burst answered after n of them."""
    monkeypatch.setattr(small_objects, "BUSY_WAIT_MS", 500)
    rows = small_objects.SmallObjects(str(tmp_path))
    holder = holding_the_write_lock(rows.path)

    def waited(n: int) -> float:
        called = time.monotonic()
        with pytest.raises(StorageUnavailable):
            rows.create([(f"inbox/s/{n}", b"x", '"e"')], wait=True)
        return time.monotonic() - called

    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with ThreadPoolExecutor(6) as threads:
            waits = list(threads.map(waited, range(6)))
        assert max(waits) < 3 * small_objects.BUSY_WAIT_MS / 1000, waits  # 6 in turn: 6 of them
    finally:
        holder.communicate(b"", timeout=10)
        rows.close()


def test_a_damaged_table_is_the_store_unavailable_not_a_crash(tmp_path: Path) -> None:
    folder = tmp_path / ".small"
    folder.mkdir()
    (folder / small_objects.DATABASE).write_bytes(b"not a database at all" * 100)
    from torpor.errors import ConfigError

    with pytest.raises(ConfigError, match="small objects"):
        LocalObjectStore(tmp_path)


def connections_to(path: Path) -> int:
    """How many of this process's descriptors are open on ``path``: each SQLite
    connection holds one on its database file while it is open."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.parametrize("when", ["first-open", "reopen-after-close"])
def test_an_open_that_fails_leaves_no_connection_open(tmp_path: Path, when: str) -> None:
    # ``_open`` made both connections before the steps that may fail (the switch to
    # WAL, the schema, the log's first write): a failure raised StorageUnavailable and
    # left them open. Reopening after ``close`` (every use of a closed store does) left
    # two more open on each failed call, while the store counted itself closed.
    folder = tmp_path / "rows"
    database = folder / small_objects.DATABASE
    if when == "first-open":
        folder.mkdir()
        database.write_bytes(b"not a database at all" * 100)
        with pytest.raises(StorageUnavailable) as failed:
            small_objects.SmallObjects(str(folder))
        assert connections_to(database) == 0, failed.value
        return
    rows = small_objects.SmallObjects(str(folder))
    rows.create([("inbox/s/a", b"a", "e")], wait=True)
    assert connections_to(database) == 2  # the count sees the store's own two
    rows.close()
    assert connections_to(database) == 0
    for name in (small_objects.DATABASE + "-wal", small_objects.DATABASE + "-shm"):
        (folder / name).unlink(missing_ok=True)
    database.write_bytes(b"not a database at all" * 100)  # damaged while closed
    for _ in range(3):
        with pytest.raises(StorageUnavailable):
            rows.get("inbox/s/a", wait=True)
        assert connections_to(database) == 0


def test_sqlite_refusals_for_a_lock_are_told_apart() -> None:
    locked = sqlite3.OperationalError("database is locked")
    assert small_objects._locked(locked)
    assert not small_objects._locked(sqlite3.OperationalError("disk I/O error"))


async def test_rows_used_again_after_close_open_again(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/a", b"a")
    await store.close()
    await store.put_if_absent("inbox/s/b", b"b")  # as the store's files do
    assert (await store.list("inbox/s/")).keys == ["inbox/s/a", "inbox/s/b"]
    await store.close()
    await store.close()


def test_a_forked_childs_durable_row_outlives_its_parents_close_and_its_own_crash(
    tmp_path: Path,
) -> None:
    """SQLite keeps its locks' bookkeeping per process: a child whose new connections
    share it with the parent's, inherited, takes no lock of its own. The parent's close
    then finds itself the last user, checkpoints and removes the table's log, and the
    child commits on into a log no name leads to: lost with the child."""
    store = LocalObjectStore(tmp_path)
    asyncio.run(store.put_if_absent("inbox/s/parent", b"p"))
    to_parent_r, to_parent = os.pipe()
    to_child, to_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a row, then (once its parent closed) a durable one
        try:

            async def child() -> None:
                await store.put_if_absent("inbox/s/child-1", b"c1")
                os.write(to_parent, b"1")
                os.read(to_child, 1)
                await store.put_if_absent("inbox/s/child-2", b"c2")
                os.write(to_parent, b"2")

            asyncio.run(child())
            os.read(to_child, 1)  # killed here
        finally:
            os._exit(1)
    try:
        assert os.read(to_parent_r, 1) == b"1"
        asyncio.run(store.close())
        os.write(to_child_w, b"go")
        assert os.read(to_parent_r, 1) == b"2", "the child's create failed"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    async def after() -> None:
        fresh = LocalObjectStore(tmp_path)
        assert (await fresh.get("inbox/s/child-1")).data == b"c1"
        assert (await fresh.get("inbox/s/child-2")).data == b"c2"
        await fresh.close()

    asyncio.run(after())


def _create_and_sync(rows: small_objects.SmallObjects) -> None:
    _, ticket = rows.create([("inbox/s/child", b"c", '"c"')], wait=True)
    rows.sync(ticket)


def test_a_child_forked_while_a_thread_flushes_the_rows_flushes_its_own(tmp_path: Path) -> None:
    """A lock a parent's thread held at the fork stays held in the child, where that
    thread does not exist: the child's first flush waited for it for ever."""
    entered, release = threading.Event(), threading.Event()

    def slow_flush(fd: int) -> None:
        if threading.current_thread().name == "flusher":
            entered.set()
            release.wait()
        os.fdatasync(fd)

    rows = small_objects.SmallObjects(str(tmp_path / ".small"), flush=slow_flush)
    _, ticket = rows.create([("inbox/s/parent", b"p", '"p"')], wait=True)
    flusher = threading.Thread(target=rows.sync, args=(ticket,), name="flusher")
    flusher.start()
    try:
        assert entered.wait(30)
        child = multiprocessing.get_context("fork").Process(target=_create_and_sync, args=(rows,))
        child.start()
        child.join(30)
        stuck = child.is_alive()
        if stuck:
            child.kill()
            child.join()
        assert not stuck, "the child waited for its parent's flush"
        assert child.exitcode == 0
    finally:
        release.set()
        flusher.join()
        rows.close()


def _durable_in_child(store: LocalObjectStore, staged: Staged) -> None:
    async def child() -> None:
        await store.get("inbox/s/staged")  # the child's own connections, opened
        await asyncio.wait_for(staged.durable(), 20)

    asyncio.run(child())


async def test_a_row_staged_before_a_fork_is_made_durable_in_the_child(tmp_path: Path) -> None:
    """The child numbered its commits from zero again: a ticket its parent handed out
    was never reached, and waiting for it flushed on for ever."""
    store = LocalObjectStore(tmp_path)
    for n in range(3):
        await store.put_if_absent(f"inbox/s/{n}", b"n")
    staged = await store.stage_if_absent("inbox/s/staged", b"event")
    child = multiprocessing.get_context("fork").Process(
        target=_durable_in_child, args=(store, staged)
    )
    child.start()
    await asyncio.to_thread(child.join, 60)
    assert child.exitcode == 0
    await store.close()


async def test_a_file_moved_in_and_then_deleted_stays_deleted_after_a_reboot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older version logged its files' writes (``storage.wal``); moving one in removed
    the file without logging it, so the next boot's replay of that log, its last word on
    the key a put, wrote the file again and the next open moved it in again: an inbox
    event the purge had deleted came back."""
    boot = ["boot-a"]
    monkeypatch.setattr(wal, "boot_id", lambda: boot[0])
    old = LocalObjectStore(tmp_path)
    old._put("inbox/s/e", b"event")  # as the older version wrote it: a file, logged
    await old.close()
    store = LocalObjectStore(tmp_path)  # this version, the same boot: moved in
    assert (await store.get("inbox/s/e")).data == b"event"
    await store.delete("inbox/s/e")  # purged
    await store.close()
    boot[0] = "boot-b"
    rebooted = LocalObjectStore(tmp_path)
    with pytest.raises(ObjectNotFound):
        await rebooted.get("inbox/s/e")
    await rebooted.close()


async def test_the_rows_log_is_checkpointed_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint flushes twice: never on the caller's thread, where a quiet store
    flushes its rows (``_Inline``), and never as part of a write."""
    monkeypatch.setattr(small_objects, "CHECKPOINT_EVERY", 4)
    store = LocalObjectStore(tmp_path)
    threads: list[str] = []
    checkpoint = store._rows.checkpoint

    def recorded() -> None:
        threads.append(threading.current_thread().name)
        checkpoint()

    store._rows.checkpoint = recorded  # type: ignore[method-assign]
    for i in range(12):
        await store.put_if_absent(f"inbox/s/{i}", b"x")
    await eventually(lambda: len(threads) >= 3, what="checkpoints")
    # One a CHECKPOINT_EVERY flushes, each submitted once (the writes went on while the
    # first ran: asking "due?" again must not have sent more).
    assert len(threads) == 3, threads
    assert threading.current_thread().name not in threads
    assert all(name.startswith("torpor-files") for name in threads)
    wal = tmp_path / ".small" / (small_objects.DATABASE + "-wal")
    assert wal.stat().st_size < 4096 * 64  # copied back, the log reused
    await store.close()


async def test_the_rows_log_stays_bounded_under_writes_that_never_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log that outgrew ``LOG_LIMIT_BYTES`` is emptied: restarts that missed their turn
    (before them, passive checkpoints alone: 98 MB for 5,000 events of 1.5 kB)."""
    monkeypatch.setattr(small_objects, "LOG_LIMIT_BYTES", 1024 * 1024)
    store = LocalObjectStore(tmp_path)
    log = Path(store._rows.path + "-wal")
    event, peak = os.urandom(1500), 0
    for n in range(4000):
        await store.put_if_absent(f"inbox/s/{n}", event)
        peak = max(peak, log.stat().st_size)
    # Emptied once past 1 MiB: what 256 flushes add between two checkpoints (~5 MiB)
    # and a checkpoint late on a loaded machine, not 77 MiB.
    assert peak < 24 * 1024 * 1024, peak
    for n in (0, 3999):  # emptied into the database, nothing lost
        assert (await store.get(f"inbox/s/{n}")).data == event
    await store.close()


async def test_the_rows_log_is_written_over_from_its_start_under_writes_that_never_pause(
    tmp_path: Path,
) -> None:
    """Each checkpoint has the next commit write the log from its start: one webhook
    after another never gave a passive checkpoint a moment with no commit coming in, so
    every commit was appended, each flush of the disk writing the file's new size too,
    until the log outgrew ``LOG_LIMIT_BYTES`` and was emptied."""
    store = LocalObjectStore(tmp_path)
    log = Path(store._rows.path + "-wal")
    event, sizes = os.urandom(1500), []
    for n in range(3000):
        await store.put_if_absent(f"inbox/s/{n}", event)
        sizes.append(log.stat().st_size)
    assert all(b >= a for a, b in itertools.pairwise(sizes)), "the log was emptied"
    # What 256 flushes add between two checkpoints (~5 MiB), and one restart that missed
    # its turn on a loaded machine: written over, the file keeps that size.
    assert max(sizes) < 12 * 1024 * 1024, max(sizes)
    for n in (0, 2999):  # copied into the database, nothing lost
        assert (await store.get(f"inbox/s/{n}")).data == event
    await store.close()


async def test_a_restart_that_misses_its_turn_is_counted_and_the_next_one_restarts(
    tmp_path: Path,
) -> None:
    """A reader in the log (another process's, here a connection of its own) holds a
    restart off past its wait: the checkpoint says so in its figures instead of passing
    for done, and the next one, the reader gone, starts the log again."""
    store = LocalObjectStore(tmp_path)
    rows = store._rows
    for n in range(20):
        await store.put_if_absent(f"inbox/s/{n}", b"event")
    reader = sqlite3.connect(rows.path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM objects").fetchone() == (20,)
        rows.checkpoint()
        grown = rows.upkeep.log_bytes
        assert grown > 0, "the log had grown"
        assert (rows.upkeep.restarts, rows.upkeep.missed) == (0, 1), vars(rows.upkeep)
        reader.execute("COMMIT")
    finally:
        reader.close()
    rows.checkpoint()
    assert (rows.upkeep.restarts, rows.upkeep.missed, rows.upkeep.truncations) == (1, 1, 0)
    assert store.figures() == {
        "rows_log_bytes": rows.upkeep.log_bytes,
        "rows_log_restarts": 1,
        "rows_log_truncations": 0,
        "rows_log_checkpoints_missed": 1,
    }
    await store.put_if_absent("inbox/s/after", b"event")  # written over the log's start
    assert os.stat(rows.path + "-wal").st_size == rows.upkeep.log_bytes >= grown
    assert (await store.get("inbox/s/0")).data == b"event"
    await store.close()


@pytest.mark.parametrize("mode", ["RESTART", "TRUNCATE"])
def test_a_checkpoint_gives_its_connection_back_the_wait_it_had(tmp_path: Path, mode: str) -> None:
    """The checkpoint's short wait is set on the connection of a call whose wait counts
    from the call (``_waited_for``): what was left of it is what the rest of the call
    waits, not a fresh ``BUSY_WAIT_MS`` (30 s) past its deadline."""
    db = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA busy_timeout=1234")
        assert small_objects._waited_checkpoint(db, mode, 10) is True
        assert db.execute("PRAGMA busy_timeout").fetchone() == (1234,)
    finally:
        db.close()


async def test_a_forked_child_counts_only_its_own_checkpoints(tmp_path: Path) -> None:
    """A child forked after its parent's checkpoints reports none of them, before its
    first use of the store (its counts were still the parent's) and after it."""
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/parent", b"p")
    store._rows.checkpoint()
    assert store.figures()["rows_log_restarts"] == 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            before = store.figures()
            asyncio.run(store.put_if_absent("inbox/s/child", b"c"))
            after = store.figures()
            os.write(write, json.dumps([before, after]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with os.fdopen(read, "rb") as answer:
        before, after = json.loads(answer.read())
    assert before["rows_log_restarts"] == after["rows_log_restarts"] == 0, (before, after)
    assert store.figures()["rows_log_restarts"] == 1  # the parent's own, kept
    await store.close()


@pytest.mark.parametrize("reader", [False, True], ids=["alone", "a-reader-in-the-log"])
async def test_a_log_past_its_limit_is_emptied_and_counted_so_unless_it_misses_its_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: bool
) -> None:
    """Past ``LOG_LIMIT_BYTES`` the checkpoint empties the log, and counts a truncation;
    held off past its wait by a reader, it counts a missed turn and the log keeps its
    size."""
    store = LocalObjectStore(tmp_path)
    rows = store._rows
    for n in range(5):
        await store.put_if_absent(f"inbox/s/{n}", b"event")
    monkeypatch.setattr(small_objects, "LOG_LIMIT_BYTES", 1)
    other = sqlite3.connect(rows.path, isolation_level=None)
    try:
        if reader:
            other.execute("BEGIN")
            assert other.execute("SELECT count(*) FROM objects").fetchone() == (5,)
        rows.checkpoint()
    finally:
        other.close()
    figures = store.figures()
    grown = figures["rows_log_bytes"]
    assert grown > 1
    counted = (figures["rows_log_truncations"], figures["rows_log_checkpoints_missed"])
    assert counted == ((0, 1) if reader else (1, 0)), figures
    assert figures["rows_log_restarts"] == 0
    emptied = os.stat(rows.path + "-wal").st_size < grown  # one frame: the log's start
    assert emptied is not reader
    await store.close()


_RESTARTING_CHILD = """
import asyncio, sys
from storage.local_store import LocalObjectStore

async def main(folder):
    store = LocalObjectStore(folder)
    for n in range(200):  # fewer than CHECKPOINT_EVERY: no checkpoint of its own meanwhile
        await store.put_if_absent(f"inbox/s/{n}", b"event %d" % n)
    store._rows.checkpoint()  # dies there, the log copied and set to restart
    print("survived", flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_a_writer_killed_after_the_log_is_set_to_restart_loses_no_row(tmp_path: Path) -> None:
    """Killed between the restart's copy and the small write that starts the log again:
    every row it acknowledged is read back, and the next writer, writing the log over
    from its start, loses none of them either."""
    killed_child(_RESTARTING_CHILD, str(tmp_path), at=CrashPoint.STORE_LOG_RESTARTED)

    async def after() -> None:
        store = LocalObjectStore(tmp_path)
        for n in range(200, 400):  # over the log's first frames, the dead writer's rows
            await store.put_if_absent(f"inbox/s/{n}", b"event %d" % n)
        await store.close()
        store = LocalObjectStore(tmp_path)
        for n in range(400):
            assert (await store.get(f"inbox/s/{n}")).data == b"event %d" % n
        await store.close()

    asyncio.run(after())


async def test_a_prefix_no_key_can_start_with_lists_no_row(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/e", b"x")
    for prefix in ("inbox/\U0010ffff", "inbox/\ud7ff", "inbox/é"):
        assert (await store.list(prefix)).keys == []
        assert (await store.walk(prefix)).keys == []
    await store.close()


async def test_after_a_failed_flush_no_row_is_reported_durable_again(tmp_path: Path) -> None:
    """A flush that failed may have dropped the log's pages, and the next one then
    reports success for nothing written (and the log is read back only up to the hole):
    every later durable write fails, typed, where it was acknowledged."""
    store = LocalObjectStore(tmp_path)
    store._rows._flush = FailingOnce(store._rows._flush)
    with pytest.raises(StorageUnavailable):
        await store.put_if_absent("inbox/s/a", b"a")
    with pytest.raises(StorageUnavailable, match="a flush of the log failed"):
        await store.put_if_absent("inbox/s/b", b"b")  # the disk answers again: not enough
    with pytest.raises(StorageUnavailable):
        await store.delete("inbox/s/a")
    assert (await store.get("inbox/s/b")).data == b"b"  # visible, never acknowledged
    other = LocalObjectStore(tmp_path)  # another store of this process: the same
    with pytest.raises(StorageUnavailable, match="a flush of the log failed"):
        await other.put_if_absent("inbox/s/c", b"c")
    await other.close()
    await store.put_if_absent("kept/s", b"files have their own log")
    await store.close()


async def test_a_failed_flush_of_the_rows_log_is_trouble_the_store_reports(
    tmp_path: Path,
) -> None:
    """From a failed flush on, every row write of the process fails: its health checks
    (/healthz warnings, the trouble gauge and its alert) must say so, not stay clean."""
    store = LocalObjectStore(tmp_path)
    assert store.trouble() is None
    store._rows._flush = FailingOnce(store._rows._flush)
    with pytest.raises(StorageUnavailable):
        await store.put_if_absent("inbox/s/a", b"a")
    trouble = store.trouble()
    assert trouble is not None and "Input/output error" in trouble, trouble
    assert "small objects" in trouble, trouble
    await store.close()


# A process whose flush of the rows' log fails (what a failed writeback reports), in the
# boot it is told: its row write is refused, it leaves ``failed-<boot>`` beside the
# table, and it exits.
_FAILING_ROWS_FLUSH = """
import asyncio, errno, sys
from storage import wal
from storage.local_store import LocalObjectStore
from torpor.errors import StorageUnavailable

wal.boot_id = lambda: sys.argv[2]

def flush(fd):
    raise OSError(errno.EIO, "Input/output error")

store = LocalObjectStore(sys.argv[1])
store._rows._flush = flush
try:
    asyncio.run(store.put_if_absent("inbox/child/" + sys.argv[2], b"child"))
except StorageUnavailable:
    print("refused")
else:
    sys.exit("the child's flush did not fail")
"""


def fail_a_rows_flush_in_another_process(root: Path, boot: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _FAILING_ROWS_FLUSH, str(root), boot],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.strip() == b"refused", child.stdout


async def test_a_rows_flush_failed_in_another_process_refuses_this_ones_row_writes(
    tmp_path: Path, boot: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed flush may have dropped pages of the one log every process of the host
    writes, and this process's next flush may then succeed without writing them: from
    then on none of its row writes is acknowledged either, not only the failing
    process's. Its flush looks, not only its ager: a flush that ends after another
    process's failed is the one that may have succeeded falsely."""
    monkeypatch.setattr(wal, "AGE_POLL_S", 3600.0)  # the ager's first look finds nothing
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s/a", b"a")  # durable: the disk was fine
    fail_a_rows_flush_in_another_process(tmp_path, boot[0])
    with pytest.raises(StorageUnavailable, match="another process"):
        await store.put_if_absent("inbox/s/b", b"b")
    with pytest.raises(StorageUnavailable, match="another process"):
        await store.delete("inbox/s/a")
    await store.put_if_absent("kept/s", b"files have their own log")
    await store.close()


async def test_a_store_that_has_not_written_since_another_process_failed_a_rows_flush_reports_it(
    tmp_path: Path, boot: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It runs no flush that would find ``failed-<boot>``: its log's ager looks for it
    (every ``wal.AGE_POLL_S``), or its health stays clean while every webhook it takes
    would be refused."""
    monkeypatch.setattr(wal, "AGE_POLL_S", 0.05)
    quiet = LocalObjectStore(tmp_path)
    assert quiet.trouble() is None
    fail_a_rows_flush_in_another_process(tmp_path, boot[0])
    await eventually(lambda: quiet.trouble() is not None, timeout_s=10, what="the quiet store")
    trouble = quiet.trouble()
    assert trouble is not None and "small objects" in trouble and "another process" in trouble
    await quiet.close()


async def test_a_rows_flush_failed_in_an_earlier_boot_refuses_nothing_after_a_reboot(
    tmp_path: Path, boot: list[str]
) -> None:
    """After a reboot the page cache holds none of the pages the failed flush dropped:
    the earlier boot's marker must not refuse the new boot's writes for ever."""
    fail_a_rows_flush_in_another_process(tmp_path, "boot-a")
    rows_folder = str(tmp_path / ".small")
    assert wal.failure_recorded(rows_folder, "boot-a"), "the failing process left its marker"
    boot[0] = "boot-b"
    store = LocalObjectStore(tmp_path)
    assert store._rows.look_for_failure() is None
    await store.put_if_absent("inbox/s/a", b"a")
    assert store.trouble() is None
    await store.close()


def test_an_earlier_boots_failed_rows_flush_leaves_no_marker_once_the_table_is_opened_again(
    tmp_path: Path,
) -> None:
    """Each boot whose disk failed a flush would otherwise leave one more file beside
    the table, for good; the current boot's own stays."""
    rows_folder = str(tmp_path / ".small")
    fail_a_rows_flush_in_another_process(tmp_path, "boot-a")
    assert wal.failure_recorded(rows_folder, "boot-a")
    # A process of the next boot opens the table, and its disk fails a flush too.
    fail_a_rows_flush_in_another_process(tmp_path, "boot-b")
    assert not wal.failure_recorded(rows_folder, "boot-a")
    assert wal.failure_recorded(rows_folder, "boot-b")


def _open_rows_at(folder: str, start: object, answers: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    try:
        small_objects.SmallObjects(folder).close()
        answers.put("")  # type: ignore[attr-defined]
    except Exception as exc:  # reported to the test
        answers.put(repr(exc))  # type: ignore[attr-defined]


def test_processes_that_open_a_new_table_together_all_open_it(tmp_path: Path) -> None:
    """Workers of a race, or replicas started at once, opening a folder no one used
    yet: SQLite's switch into WAL mode waits for no busy handler, and one in a dozen
    such starts failed with "database is locked" (a race's workers then waited at
    their barrier for the one that died, until the test's timeout)."""
    ctx = multiprocessing.get_context("fork")
    failed = []
    for attempt in range(40):
        folder = str(tmp_path / f"{attempt}" / ".small")
        start, answers = ctx.Event(), ctx.Queue()
        workers = [
            ctx.Process(target=_open_rows_at, args=(folder, start, answers)) for _ in range(8)
        ]
        for worker in workers:
            worker.start()
        start.set()
        failed += [e for e in (answers.get(timeout=60) for _ in workers) if e]
        for worker in workers:
            worker.join(timeout=60)
    assert failed == []


def test_a_child_forked_while_a_thread_reopens_the_rows_opens_its_own(tmp_path: Path) -> None:
    """A parent's thread reopening the rows (used again after ``close``) holds their
    ``_opening`` lock at the fork: the child's first use opens them too, and must not
    wait for a lock no thread of its own will ever release."""
    store = LocalObjectStore(tmp_path)
    asyncio.run(store.put_if_absent("inbox/s/parent", b"p"))
    with store._rows._opening:  # as the parent's reopening thread holds it
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)  # a child that waits for ever is killed, and fails
                assert asyncio.run(store.get("inbox/s/parent")).data == b"p"
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    asyncio.run(store.close())
