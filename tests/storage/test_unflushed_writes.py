"""A write to the local folder store killed before it was logged, then a power cut: the
key holds an object whole, the old one or the new one, never a file whose name reached
the disk before its bytes did.

The folder's file system may write a folder's entries and a file's bytes back in any
order (this machine's ext4 has no journal). A write renames its file into place and
only then logs the change, so a process killed between the two leaves a rename that no
record can redo or undo after a power cut. The store flushes a file's bytes before it
renames the file into place: whatever of the rename the disk kept, it names whole bytes.

The power cut is simulated the way it shows on disk: the child that dies records each
file it flushed (by inode), and every object file it did not flush loses its bytes."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storage import wal
from storage.local_store import LocalObjectStore
from tests.conftest import eventually
from tests.storage.conftest import ROOT, killed_child
from tests.storage.test_local_store_fast_paths import leftovers
from torpor.errors import ObjectNotFound, StorageUnavailable
from torpor.faults import CrashPoint

pytestmark = pytest.mark.timeout(60)

OLD, NEW = b"the old content, acknowledged", b"the new content, never acknowledged"

# A child's start: the test's boot (a reboot is a store opened in another), and every
# flush recorded, by inode, in the file named by its third argument.
RECORDING = """
import asyncio, os, sys
from storage import wal

wal.boot_id = lambda: "boot-a"
from storage.local_store import LocalObjectStore

flushed = open(sys.argv[3], "a")

def recording(flush):
    def flushes(fd):
        flush(fd)
        flushed.write(f"{os.fstat(fd).st_ino}\\n")
        flushed.flush()
    return flushes

os.fsync, os.fdatasync = recording(os.fsync), recording(os.fdatasync)
"""

CHILD = (
    RECORDING
    + """

async def main(folder, op):
    store = LocalObjectStore(folder)
    if op == "put":
        await store.put("sessions/k", NEW)
    elif op == "cas":
        await store.put_if_match("sessions/k", NEW, etag=(await store.get("sessions/k")).etag)
    else:
        await store.put_if_absent("sessions/created", NEW)
    print("survived", flush=True)

NEW = sys.argv[4].encode()
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
)


def checkpointed(folder: Path) -> None:
    """``sessions/k = OLD``, acknowledged and then covered by a checkpoint: no record of
    it is left to replay, the file on disk is all there is of it."""
    store = LocalObjectStore(folder)
    asyncio.run(store.put("sessions/k", OLD))
    store._log.close()  # retires its segment: a checkpoint in the background

    def logged() -> bool:
        for path in (folder / ".wal").glob("*.log"):
            try:
                if len(list(wal.decode(path.read_bytes()))) > 1:
                    return True
            except FileNotFoundError:
                continue
        return False

    asyncio.run(eventually(lambda: not logged(), timeout_s=10.0, what="the checkpoint"))


def inodes(folder: Path) -> set[int]:
    return {path.stat().st_ino for path in (folder / "objects").rglob("*") if path.is_file()}


def power_cut(folder: Path, durable: set[int], flushed: Path) -> None:
    """Every object file that was neither on disk before the child ran (``durable``: a
    checkpoint flushed them) nor flushed by the child loses its bytes: its name reached
    the disk, its bytes did not."""
    kept = durable | {int(line) for line in flushed.read_text().split()}
    for path in (folder / "objects").rglob("*"):
        if path.is_file() and path.stat().st_ino not in kept:
            path.write_bytes(b"")


def read(folder: Path, key: str) -> bytes | None:
    try:
        return asyncio.run(LocalObjectStore(folder).get(key)).data
    except ObjectNotFound:
        return None


def killed_then_power_cut(folder: Path, boot: list[str], op: str, at: CrashPoint) -> None:
    """``sessions/k = OLD`` checkpointed; ``op`` killed at ``at`` in a child; the power
    cut; the next store opens in another boot."""
    checkpointed(folder)
    flushed = folder / "flushed"
    flushed.touch()
    durable = inodes(folder)
    killed_child(CHILD, str(folder), op, str(flushed), NEW.decode(), at=at)
    power_cut(folder, durable, flushed)
    boot[0] = "boot-b"


@pytest.mark.parametrize("op", ["put", "cas"])
def test_a_replace_killed_before_its_record_leaves_an_object_whole_after_a_power_cut(
    tmp_path: Path, boot: list[str], op: str
) -> None:
    killed_then_power_cut(tmp_path, boot, op, CrashPoint.STORE_AFTER_SWAP)
    assert read(tmp_path, "sessions/k") in (OLD, NEW)


def test_a_create_killed_before_its_record_leaves_no_torn_object_after_a_power_cut(
    tmp_path: Path, boot: list[str]
) -> None:
    killed_then_power_cut(tmp_path, boot, "create", CrashPoint.STORE_AFTER_PLACE)
    assert read(tmp_path, "sessions/created") in (None, NEW)
    assert read(tmp_path, "sessions/k") == OLD


def failing_flush_of(monkeypatch: pytest.MonkeyPatch, doomed: bytes) -> None:
    """The disk fails the flush of any temporary file that holds ``doomed``."""
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if "/.tmp/" in path and Path(path).read_bytes() == doomed:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)


def test_a_create_whose_bytes_cannot_be_flushed_fails_alone_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(tmp_path)
    failing_flush_of(monkeypatch, b"doomed")

    async def together() -> list[object]:
        bodies = [b"first", b"doomed", b"third"]
        creates = (store.put_if_absent(f"sessions/{i}", body) for i, body in enumerate(bodies))
        return await asyncio.gather(*creates, return_exceptions=True)

    first, doomed, third = asyncio.run(together())
    assert isinstance(first, str) and isinstance(third, str)
    assert isinstance(doomed, StorageUnavailable)
    assert (read(tmp_path, "sessions/0"), read(tmp_path, "sessions/2")) == (b"first", b"third")
    assert read(tmp_path, "sessions/1") is None
    assert leftovers(store) == [], "the file that could not be flushed is removed"


def test_a_replace_whose_bytes_cannot_be_flushed_leaves_the_object_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(tmp_path)
    etag = asyncio.run(store.put_if_absent("sessions/k", OLD))
    failing_flush_of(monkeypatch, NEW)

    with pytest.raises(StorageUnavailable):
        asyncio.run(store.put_if_match("sessions/k", NEW, etag=etag))
    assert read(tmp_path, "sessions/k") == OLD
    assert leftovers(store) == []


# A large object is flushed in place, file and folder, and logged as DURABLE: a replay
# writes nothing for it. Its folder's own entry, in the folder above, must then be on
# disk too: a folder made for it (``_parent``) is renamed into place and not flushed.
LARGE_CHILD = (
    RECORDING
    + """

async def main(folder, op):
    store = LocalObjectStore(folder)
    if op == "put":
        await store.put("batch-data/b/documents.json", LARGE)
    else:
        assert await store.move("sessions/big", "ended/day/big")
    print("acknowledged", flush=True)

LARGE = b"L" * (wal.RECORD_MAX_BYTES + 1)
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
)
LARGE = b"L" * (wal.RECORD_MAX_BYTES + 1)


def folders(folder: Path) -> set[int]:
    return {path.stat().st_ino for path in (folder / "objects").rglob("*") if path.is_dir()}


def folders_lost(folder: Path, durable: set[int], flushed: Path) -> None:
    """The power cut, for folders: one made since the last flush of the file system
    (not in ``durable``) whose entry's folder was not flushed since loses its entry (and
    with it all below it; ``e2fsck`` would put it in ``lost+found``)."""
    kept = {int(line) for line in flushed.read_text().split()}
    made = [p for p in (folder / "objects").rglob("*") if p.is_dir()]
    for path in sorted(made, key=lambda p: len(p.parts)):
        if not path.exists() or path.stat().st_ino in durable:
            continue
        if path.parent.stat().st_ino not in kept:
            shutil.rmtree(path)


@pytest.mark.parametrize("op", ["put", "move"])
def test_a_large_object_acknowledged_in_a_new_folder_survives_a_power_cut(
    tmp_path: Path, boot: list[str], op: str
) -> None:
    checkpointed(tmp_path)  # ``sessions/`` on disk
    if op == "move":
        store = LocalObjectStore(tmp_path)
        asyncio.run(store.put("sessions/big", LARGE))  # flushed in place, durable
        asyncio.run(store.close())
    flushed = tmp_path / "flushed"
    flushed.touch()
    durable_files, durable_folders = inodes(tmp_path), folders(tmp_path)
    child = subprocess.run(
        [sys.executable, "-c", LARGE_CHILD, str(tmp_path), op, str(flushed)],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert b"acknowledged" in child.stdout, child.stderr.decode()[-2000:]
    folders_lost(tmp_path, durable_folders, flushed)
    power_cut(tmp_path, durable_files, flushed)
    boot[0] = "boot-b"
    key = "batch-data/b/documents.json" if op == "put" else "ended/day/big"
    assert read(tmp_path, key) == LARGE, "acknowledged, then lost with its folder's entry"


def test_a_create_that_need_not_be_durable_never_names_bytes_that_were_not_flushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not logged, its name may be lost to a power cut; never its bytes under its name."""
    store = LocalObjectStore(tmp_path)
    flushed: set[int] = set()
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        real(fd)
        flushed.add(os.fstat(fd).st_ino)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    asyncio.run(store.put_if_absent("sessions/marker", NEW, durable=False))
    assert (tmp_path / "objects" / "sessions" / "marker").stat().st_ino in flushed
