"""Kept files outlive the process that kept them: a local folder store that closes hands
its kept files and unused blanks to the shared ``spare`` folder instead of freeing them,
and another process's store takes them from there, under the same conditions as its own
(a checkpoint after they left their keys, the quarantine), one taker each
(``storage.blanks``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage import blanks, wal
from storage.blanks import sweep
from storage.local_store import LocalObjectStore
from tests.storage.conftest import refills_done, until

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
# A process that replaces 40 objects (their old files kept), closes its store and exits;
# prints the inodes of the old files.
CLOSER = """
import asyncio, json, os, sys
from storage.local_store import LocalObjectStore

async def main(folder):
    store = LocalObjectStore(folder)
    old = []
    for i in range(40):
        etag = await store.put(f"s/{i}", b"v1 of %d" % i)
        old.append(os.stat(store._file(f"s/{i}")).st_ino)
        await store.put_if_match(f"s/{i}", b"v2", etag=etag)
    await store.close()
    print(json.dumps(old), flush=True)

asyncio.run(main(sys.argv[1]))
"""


def closed_elsewhere(folder: Path) -> set[int]:
    """Run ``CLOSER`` in a child process; the inodes of the files it kept."""
    child = subprocess.run(
        [sys.executable, "-c", CLOSER, str(folder)],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return set(json.loads(child.stdout))


def spare_inodes(folder: Path) -> dict[int, str]:
    spare = folder / ".tmp" / blanks.SPARE
    return {p.stat().st_ino: p.name for p in spare.iterdir()} if spare.exists() else {}


@pytest.fixture
def taker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalObjectStore]:
    """A store of this process on the folder, its quarantine over at once (no reader of
    these tests is left: the quarantine's own tests are in test_inode_recycling)."""
    monkeypatch.setattr(blanks, "QUARANTINE_S", 0.0)
    kept = closed_elsewhere(tmp_path)
    made = LocalObjectStore(str(tmp_path))
    made.kept = kept  # type: ignore[attr-defined]
    yield made
    asyncio.run(made.close())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalObjectStore]:
    """A store of this process on a fresh folder, closed after the test."""
    made = LocalObjectStore(str(tmp_path))
    yield made
    asyncio.run(made.close())


def checkpoint(store: LocalObjectStore) -> None:
    store._log.checkpoint([])
    store._blanks._settled_read_at = float("-inf")


def claim_all(store: LocalObjectStore) -> set[int]:
    """Every spare the store may take now, taken: their inodes."""
    refills_done(store)
    store._blanks._spares_listed_at = float("-inf")
    taken: set[int] = set()
    while (path := store._blanks._claimed()) is not None:
        status = os.stat(path)
        assert status.st_size == 0 and status.st_nlink == 1, "taken emptied, and ours alone"
        taken.add(status.st_ino)
    return taken


def test_a_closing_store_hands_its_kept_files_over_instead_of_freeing_them(
    taker: LocalObjectStore, tmp_path: Path
) -> None:
    kept: set[int] = taker.kept  # type: ignore[attr-defined]
    handed = spare_inodes(tmp_path)
    assert kept <= set(handed), "a kept file was freed at close"
    boots = {name.split("-", 2)[2] for name in handed.values()}
    assert boots == {wal.boot_id()}
    # The blanks it had made ahead and not used are handed over too, free to take at once.
    fresh = {ino for ino, name in handed.items() if name.startswith("0-")}
    assert fresh and not fresh & kept


def test_another_process_takes_a_kept_file_only_after_a_checkpoint(
    taker: LocalObjectStore, tmp_path: Path
) -> None:
    kept: set[int] = taker.kept  # type: ignore[attr-defined]
    before = claim_all(taker)
    assert before and not before & kept, "taken before its removal was on disk"
    checkpoint(taker)
    after = claim_all(taker)
    assert after == kept, "every kept file taken once a checkpoint covered it"
    assert not spare_inodes(tmp_path)


def test_a_store_short_of_blanks_takes_spares_before_it_makes_new_files(
    taker: LocalObjectStore, tmp_path: Path
) -> None:
    checkpoint(taker)
    refills_done(taker)
    taker._blanks._ready.clear()  # the blanks made before: the next ones are made now
    taker._blanks._spares_listed_at = float("-inf")
    handed = set(spare_inodes(tmp_path))
    taker._blanks._make()
    made = {os.stat(p).st_ino for p in taker._blanks._ready}
    assert len(made) == blanks.HIGH and made <= handed, "new files made while spares waited"
    for i in range(5):  # and the store writes through them as through any blank
        asyncio.run(taker.put(f"new/{i}", b"x"))
        assert asyncio.run(taker.get(f"new/{i}")).data == b"x"


def test_two_stores_taking_spares_at_once_never_take_the_same_file(
    taker: LocalObjectStore, tmp_path: Path
) -> None:
    other = LocalObjectStore(str(tmp_path))
    try:
        checkpoint(taker)
        checkpoint(other)
        total = len(spare_inodes(tmp_path))
        got: list[set[int]] = [set(), set()]
        start = threading.Barrier(2)

        def take(i: int, store: LocalObjectStore) -> None:
            start.wait()
            got[i] = claim_all(store)

        threads = [threading.Thread(target=take, args=(i, s)) for i, s in enumerate((taker, other))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not got[0] & got[1], "one file handed to two stores"
        assert len(got[0]) + len(got[1]) == total
    finally:
        asyncio.run(other.close())


def test_sweep_removes_spares_of_another_boot_and_old_bytes_and_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "STALE_S", 5.0)
    spare = tmp_path / blanks.SPARE
    spare.mkdir()
    boot, now = wal.boot_id(), time.monotonic_ns()
    kept = {
        spare / f"{now}-{'a' * 24}-{boot}": b"left its key just now",
        spare / f"0-{'b' * 24}-{boot}": b"",  # emptied before it was handed over
    }
    gone = {
        spare / f"{now - 6 * 10**9}-{'c' * 24}-{boot}": b"a deleted object's bytes, old",
        spare / f"{now}-{'d' * 24}-another-boot": b"from before a reboot",
        spare / f"\u00b2-{'e' * 24}-{boot}": b"",  # a digit int() refuses: no error
    }
    for path, data in {**kept, **gone}.items():
        path.write_bytes(data)
    assert sweep(str(tmp_path), boot=boot) == len(gone)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)


def test_a_store_listing_spares_removes_old_bytes_nobody_took(
    tmp_path: Path, store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "STALE_S", 5.0)
    spare = tmp_path / ".tmp" / blanks.SPARE
    spare.mkdir(exist_ok=True)
    old = spare / f"{time.monotonic_ns() - 6 * 10**9}-{'c' * 24}-{wal.boot_id()}"
    old.write_bytes(b"a deleted object's bytes")
    refills_done(store)
    store._blanks._spares_listed_at = float("-inf")
    store._blanks._claimed()
    assert not old.exists()


def test_a_file_named_elsewhere_too_is_never_handed_over(
    tmp_path: Path, store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_MAX", 0)
    etag = asyncio.run(store.put("k", b"v1"))
    os.link(store._file("k"), tmp_path / "backup")
    asyncio.run(store.put_if_match("k", b"v2", etag=etag))
    etag = asyncio.run(store.put("plain", b"v1"))
    asyncio.run(store.put_if_match("plain", b"v2", etag=etag))  # handed over
    until(lambda: len(spare_inodes(tmp_path)) == 1, "the plain file handed over")
    assert (tmp_path / "backup").stat().st_ino not in spare_inodes(tmp_path)
    assert (tmp_path / "backup").read_bytes() == b"v1"


def replaced(store: LocalObjectStore, folder: Path, key: str, data: bytes = b"v1") -> str:
    """What became of ``key``'s first file (``data``) once it was replaced (KEEP_MAX 0):
    "handed over" or "freed" (a worker thread decides, after the call)."""
    asyncio.run(store.put(key, data))
    fd = os.open(store._file(key), os.O_RDONLY)
    try:
        etag = asyncio.run(store.get(key)).etag
        asyncio.run(store.put_if_match(key, b"v2", etag=etag))
        ino = os.fstat(fd).st_ino
        until(lambda: os.fstat(fd).st_nlink == 0 or ino in spare_inodes(folder), "settled")
        return "freed" if os.fstat(fd).st_nlink == 0 else "handed over"
    finally:
        os.close(fd)


def test_room_made_by_others_is_seen_by_a_store_that_found_spare_full(
    tmp_path: Path, store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store counts the folder again (at most once a second; at once here): what it
    found full, another store emptied, and it hands over again."""
    monkeypatch.setattr(blanks, "KEEP_MAX", 0)
    monkeypatch.setattr(blanks, "SPARE_MAX", 1)
    monkeypatch.setattr(blanks, "RELIST_S", 0.0)
    fates = [replaced(store, tmp_path, f"k{i}") for i in range(2)]
    assert fates == ["handed over", "freed"], "spare is full after one"
    for path in (tmp_path / ".tmp" / blanks.SPARE).iterdir():
        path.unlink()  # taken by another store
    assert replaced(store, tmp_path, "k2") == "handed over"


def test_past_the_spare_limit_a_closing_store_frees_what_it_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "SPARE_MAX", 3)
    store = LocalObjectStore(str(tmp_path))
    for i in range(10):
        etag = asyncio.run(store.put(f"s/{i}", b"v1"))
        asyncio.run(store.put_if_match(f"s/{i}", b"v2", etag=etag))
    refills_done(store)
    asyncio.run(store.close())
    assert len(spare_inodes(tmp_path)) == 3
    left = [p for p in (tmp_path / ".tmp").iterdir() if p.is_file()]
    assert not left, f"kept files neither handed over nor freed: {left}"


def test_a_large_file_past_the_keep_limit_is_freed_not_handed_over(
    tmp_path: Path, store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_MAX", 0)
    large = b"x" * (blanks.SPARE_FILE_BYTES + 1)
    fates = [replaced(store, tmp_path, f"k/{len(data)}", data) for data in (b"small", large)]
    assert fates == ["handed over", "freed"]
    sizes = [p.stat().st_size for p in (tmp_path / ".tmp" / blanks.SPARE).iterdir()]
    assert sizes == [5], "the spare folder holds only small files"
