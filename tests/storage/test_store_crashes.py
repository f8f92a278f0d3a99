"""A process killed inside the local folder store's replace or delete, at the named
points between the move on disk and its log record (``torpor.faults``): the next store
finds the key as the move left it (a process crash loses nothing: the page cache is the
kernel's), the object's old file in ``.tmp`` under the dead writer's name, never handed
out by anyone else, and swept once stale. A real child process dies by SIGKILL there."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from storage import blanks, keys
from storage.local_store import LocalObjectStore, _Contended
from storage.snapshots import ObjectSnapshots, ended_day
from tests.conftest import eventually
from tests.storage.conftest import killed_child
from tests.support.factories import NOW
from torpor.errors import ObjectNotFound
from torpor.faults import ENV, CrashPoint

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = b"the old content, v1", b"the new content, v2"

CHILD = """
import asyncio, os, sys
from storage.local_store import LocalObjectStore

async def main(folder, op, old, new):
    store = LocalObjectStore(folder)
    etag = await store.put_if_absent("sessions/k", old)
    print(os.getpid(), flush=True)
    if op == "move":
        await store.move("sessions/k", "ended/k")
    elif op == "put":
        await store.put("sessions/k", new)
    elif op == "cas":
        await store.put_if_match("sessions/k", new, etag=etag)
    elif op == "cad":
        await store.delete_if_match("sessions/k", etag=etag)
    else:
        await store.delete("sessions/k")
    print("survived", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], *(a.encode() for a in sys.argv[3:5])))
"""


def killed_at(point: CrashPoint, folder: Path, op: str) -> int:
    """Run ``op`` on a fresh key in a child told to die at ``point``; its pid."""
    out = killed_child(CHILD, str(folder), op, OLD.decode(), NEW.decode(), at=point)
    return int(out.split()[0])


LAST_COMMIT = """
import asyncio, sys
from storage.local_store import LocalObjectStore, _Contended
from storage.snapshots import ObjectSnapshots
from tests.support.factories import snapshot
from torpor.lifecycle import SessionState, transition

async def main(folder, sid):
    snapshots = ObjectSnapshots(LocalObjectStore(folder))
    if not sid:  # a process of its own: its writes are not where this one dies
        print((await snapshots.create(snapshot())).session_id, flush=True)
        return
    first = await snapshots.load(sid)
    failed = transition(first, SessionState.FAILED, now=first.updated_at)
    await snapshots.save(failed, expected_generation=0)
    print("survived", flush=True)

asyncio.run(main(*sys.argv[1:3]))
"""


def holding(tmp: Path, content: bytes) -> list[Path]:
    return [p for p in tmp.iterdir() if p.is_file() and p.read_bytes() == content]


def read(store: LocalObjectStore, key: str) -> bytes | None:
    try:
        return asyncio.run(store.get(key)).data
    except ObjectNotFound:
        return None


@pytest.mark.parametrize(
    ("point", "op", "left"),
    [
        (CrashPoint.STORE_AFTER_SWAP, "put", NEW),
        (CrashPoint.STORE_AFTER_SWAP, "cas", NEW),
        (CrashPoint.STORE_AFTER_MOVE, "delete", None),
        (CrashPoint.STORE_AFTER_MOVE, "cad", None),
    ],
)
def test_a_writer_killed_between_the_move_and_its_log_record_leaves_the_key_whole(
    tmp_path: Path, point: CrashPoint, op: str, left: bytes | None
) -> None:
    pid = killed_at(point, tmp_path, op)
    tmp = tmp_path / ".tmp"
    [old] = holding(tmp, OLD)  # the object's old file, moved out of its key intact
    assert old.name.startswith(f"blank-{pid}-"), old.name

    store = LocalObjectStore(tmp_path)  # sweeps at open: the old file is young, it stays
    assert read(store, "sessions/k") == left
    # This store's own writes never take a dead writer's file: it is not theirs to empty.
    for i in range(50):
        asyncio.run(store.put(f"queue/s/e{i}", b"%d" % i))
        asyncio.run(store.delete(f"queue/s/e{i}"))
    assert holding(tmp, OLD) == [old]
    asyncio.run(store.put("sessions/k", b"v3"))
    assert read(store, "sessions/k") == b"v3"
    asyncio.run(store.close())

    at = old.stat().st_mtime - blanks.STALE_S - 60
    os.utime(old, (at, at))
    after = LocalObjectStore(tmp_path)  # its maker is gone and it is stale: swept
    asyncio.run(eventually(lambda: not old.exists(), timeout_s=10.0, what="the sweep"))
    assert read(after, "sessions/k") == b"v3"
    asyncio.run(after.close())


@pytest.mark.parametrize("point", [CrashPoint.STORE_AFTER_LINK, CrashPoint.STORE_MOVE_LOGGED])
def test_a_mover_killed_before_the_old_name_went_leaves_the_object_at_both_keys(
    tmp_path: Path, point: CrashPoint
) -> None:
    """Killed after the object was linked at its new key (before or after its log was
    flushed): it is at both keys, never at neither, and the move done again (repair
    finishing an ended session's marker) completes it."""
    killed_at(point, tmp_path, "move")
    store = LocalObjectStore(tmp_path)
    assert (read(store, "sessions/k"), read(store, "ended/k")) == (OLD, OLD)
    assert asyncio.run(store.move("sessions/k", "ended/k")) is True
    assert (read(store, "sessions/k"), read(store, "ended/k")) == (None, OLD)
    # Found linked there already: no second name of it left in ``.tmp``.
    assert os.stat(store._file("ended/k")).st_nlink == 1
    asyncio.run(store.close())


@pytest.mark.parametrize(
    "point",
    [CrashPoint.STORE_AFTER_SWAP, CrashPoint.STORE_AFTER_LINK, CrashPoint.STORE_MOVE_LOGGED],
)
def test_a_process_killed_in_a_sessions_last_commit_leaves_it_ended_and_findable(
    tmp_path: Path, point: CrashPoint
) -> None:
    """Killed inside a session's last commit: its terminal snapshot staged (not flushed),
    its marker linked at the ended key, or the move logged and flushed. The snapshot is
    terminal, the live marker is still there (the session is never at neither), and the
    full repair's walk of the live markers finishes the move."""

    def run(sid: str, crash_at: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-c", LAST_COMMIT, str(tmp_path), sid],
            cwd=ROOT,
            capture_output=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT), ENV: crash_at},
        )

    sid = run("", "").stdout.split()[0].decode()
    child = run(sid, point.value)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert b"survived" not in child.stdout
    store = LocalObjectStore(tmp_path)
    snapshots = ObjectSnapshots(store)
    assert asyncio.run(snapshots.load(sid)).state.terminal
    assert read(store, keys.live(sid)) == b"", "the live marker outlives the kill"

    async def repaired() -> list[str]:
        return [h.session_id async for h in snapshots.list_live(now=NOW)]

    assert asyncio.run(repaired()) == [], "an ended session is not walked as live"
    assert read(store, keys.live(sid)) is None
    assert read(store, keys.ended(ended_day(NOW), sid)) == b""
    assert os.stat(store._file(keys.ended(ended_day(NOW), sid))).st_nlink == 1
    asyncio.run(store.close())


FORKING_WRITER = """
import asyncio, os, signal, sys
from storage.local_store import LocalObjectStore, _Contended

store = LocalObjectStore(sys.argv[1])
asyncio.run(store.put_if_absent("sessions/k", b"v1"))  # its lock file open from here on
forked = os.fork()
if forked == 0:  # a child that outlives its parent (a pool's worker, say)
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    signal.pause()
    os._exit(0)
print(forked, flush=True)
asyncio.run(store.put("sessions/k", b"v2"))  # killed here, the key's lock held
"""


def test_a_writer_killed_holding_a_keys_lock_frees_it_though_its_forked_child_lives(
    tmp_path: Path,
) -> None:
    """A lock file's ``flock`` belongs to its open file, shared with every child forked
    since it was opened: the lock goes with the last descriptor of it. A writer killed
    holding a key's lock must leave it free though a child it forked before still runs,
    or every write of that key (and of its stripe) waits for that child for ever."""
    child = subprocess.run(
        [sys.executable, "-c", FORKING_WRITER, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT), ENV: CrashPoint.STORE_AFTER_SWAP.value},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    forked = int(child.stdout.split()[0])
    try:
        store = LocalObjectStore(tmp_path)
        try:
            with store._locked("sessions/k", wait=False):
                pass
        except _Contended:
            pytest.fail("the killed writer's lock is held by its child's copy of the file")
        asyncio.run(store.put("sessions/k", b"v3"))
        assert read(store, "sessions/k") == b"v3"
        asyncio.run(store.close())
    finally:
        os.kill(forked, signal.SIGKILL)
