"""The local folder store keeps the files of replaced and removed objects to recycle
them as blanks, instead of freeing their inodes (``storage.blanks``), and its readers
never return the content a recycled file was given after they opened it."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from storage import blanks, local_files, local_fs, wal
from storage.local_store import INLINE_READ_BYTES, LocalObjectStore
from tests.storage.conftest import refills_done, until
from torpor.errors import InvalidKey

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalObjectStore]:
    made = LocalObjectStore(str(tmp_path))
    yield made
    asyncio.run(made.close())


def quarantine_over(store: LocalObjectStore) -> None:
    """Every kept file's quarantine ends now (no reader of this test is left)."""
    refills_done(store)  # one under way could take the file the test looks for
    made = store._blanks
    with made._lock:
        kept = [(0.0, left, path, size) for _, left, path, size in made._cooling]
        made._cooling.clear()
        made._cooling.extend(kept)


def checkpoint(store: LocalObjectStore) -> None:
    """A real checkpoint of the store's log: ``syncfs``, then the boot's mark."""
    store._log.checkpoint([])
    store._blanks._settled_read_at = float("-inf")  # read the new mark at once


def file_of(store: LocalObjectStore, key: str) -> int:
    """A descriptor of ``key``'s file as it is now (the caller closes it)."""
    return os.open(store._file(key), os.O_RDONLY)


def links_after_replacing(store: LocalObjectStore, key: str, etag: str, data: bytes) -> int:
    """How many names ``key``'s file has once ``key`` is swapped to ``data``: 1 if it is
    kept to be recycled, 0 if it was freed."""
    fd = file_of(store, key)
    try:
        asyncio.run(store.put_if_match(key, data, etag=etag))
        return os.fstat(fd).st_nlink
    finally:
        os.close(fd)


def test_a_compare_and_swap_keeps_the_replaced_file_instead_of_freeing_it(
    store: LocalObjectStore,
) -> None:
    etag = asyncio.run(store.put("sessions/s", b"v1"))
    fd = file_of(store, "sessions/s")
    try:
        asyncio.run(store.put_if_match("sessions/s", b"v2", etag=etag))
        assert os.fstat(fd).st_nlink == 1, "the old file was freed, not kept"
        assert os.pread(fd, 10, 0) == b"v1", "the old file is untouched while in quarantine"
    finally:
        os.close(fd)
    assert asyncio.run(store.get("sessions/s")).data == b"v2"
    assert len(store._blanks._cooling) == 1


def test_an_overwriting_put_and_a_delete_keep_their_files_too(store: LocalObjectStore) -> None:
    asyncio.run(store.put("a/k", b"v1"))
    first = file_of(store, "a/k")
    asyncio.run(store.put("a/k", b"v2"))
    second = file_of(store, "a/k")
    asyncio.run(store.delete("a/k"))
    try:
        assert os.fstat(first).st_nlink == 1 and os.fstat(second).st_nlink == 1
        assert not Path(store._file("a/k")).exists()
    finally:
        os.close(first)
        os.close(second)
    assert len(store._blanks._cooling) == 2


def test_a_kept_file_is_a_blank_again_only_after_its_quarantine(
    store: LocalObjectStore,
) -> None:
    etag = asyncio.run(store.put("sessions/s", b"v1" * 100))
    old_inode = os.stat(store._file("sessions/s")).st_ino
    asyncio.run(store.put_if_match("sessions/s", b"v2", etag=etag))
    checkpoint(store)
    assert store._blanks._reused() is None, "handed out while a reader may still read it"
    quarantine_over(store)
    path = store._blanks._reused()
    assert path is not None
    status = os.stat(path)
    assert status.st_ino == old_inode and status.st_size == 0, "recycled, and emptied"


def test_a_kept_file_is_not_reused_before_a_checkpoint_puts_its_removal_on_disk(
    store: LocalObjectStore,
) -> None:
    """Without a journal, a power cut could leave the old key naming the file after a
    new key took it: only a ``syncfs`` begun after the swap makes reuse safe."""
    checkpoint(store)  # a mark from before the swap does not count
    etag = asyncio.run(store.put("sessions/s", b"v1"))
    asyncio.run(store.put_if_match("sessions/s", b"v2", etag=etag))
    quarantine_over(store)
    assert store._blanks._reused() is None, "reused before its removal was on disk"
    checkpoint(store)
    assert store._blanks._reused() is not None


def test_blanks_come_from_recycled_files_once_they_may_be_reused(
    store: LocalObjectStore,
) -> None:
    etags = {i: asyncio.run(store.put(f"s/{i}", b"v1")) for i in range(40)}
    inodes = {os.stat(store._file(f"s/{i}")).st_ino for i in range(40)}
    for i in range(40):
        asyncio.run(store.put_if_match(f"s/{i}", b"v2", etag=etags[i]))
    refills_done(store)
    checkpoint(store)
    quarantine_over(store)
    store._blanks._ready.clear()  # the blanks made before: the next ones are made now
    store._blanks._make()
    made = {os.stat(p).st_ino for p in store._blanks._ready}
    assert made and made <= inodes, "new inodes were made while recycled ones waited"


def spares(store: LocalObjectStore) -> dict[int, str]:
    """The files handed over to other processes: inode -> name."""
    folder = Path(store._tmp) / blanks.SPARE
    return {p.stat().st_ino: p.name for p in folder.iterdir()} if folder.exists() else {}


def test_past_the_limit_a_replaced_file_is_handed_over_and_past_the_spares_freed(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_MAX", 1)
    monkeypatch.setattr(blanks, "SPARE_MAX", 1)
    etag = asyncio.run(store.put("k", b"v1"))
    etag = asyncio.run(store.put_if_match("k", b"v2", etag=etag))  # v1's file: kept
    fd = file_of(store, "k")
    try:
        etag = asyncio.run(store.put_if_match("k", b"v3", etag=etag))
        ino = os.fstat(fd).st_ino
        until(lambda: ino in spares(store), "past the limit, v2's file goes to spare")
    finally:
        os.close(fd)
    left_ns, _, boot = spares(store)[ino].split("-", 2)
    assert int(left_ns) > 0 and boot == wal.boot_id()
    assert freed_after_replacing(store, "k", etag, b"v4"), "freed past both limits"
    assert len(store._blanks._cooling) == 1 and len(spares(store)) == 1


def freed_after_replacing(store: LocalObjectStore, key: str, etag: str, data: bytes) -> bool:
    """Whether ``key``'s file is freed (no name left) once ``key`` is swapped to
    ``data``: past the bounds that happens in a worker thread, after the call."""
    fd = file_of(store, key)
    try:
        asyncio.run(store.put_if_match(key, data, etag=etag))
        try:
            until(lambda: os.fstat(fd).st_nlink == 0, "freed", timeout_s=5.0)
        except AssertionError:
            return False
        return True
    finally:
        os.close(fd)


def test_a_replaced_file_past_the_byte_budget_is_freed(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_BYTES", 1000)
    monkeypatch.setattr(blanks, "SPARE_MAX", 0)  # nothing handed over: freed
    etag = asyncio.run(store.put("small", b"s" * 600))
    asyncio.run(store.put_if_match("small", b"t", etag=etag))
    etag = asyncio.run(store.put("large", b"l" * 600))
    freed = freed_after_replacing(store, "large", etag, b"m")
    assert freed, "kept past the byte budget (600 + 600 > 1000)"
    assert len(store._blanks._cooling) == 1 and store._blanks._kept_bytes == 600


def test_where_files_cannot_be_swapped_a_replace_still_replaces(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_fs, "_no_exchange", [True])
    etag = asyncio.run(store.put("k", b"v1"))
    assert links_after_replacing(store, "k", etag, b"v2") == 0
    assert asyncio.run(store.get("k")).data == b"v2"
    assert not store._blanks._cooling


def stalled_reader(
    store: LocalObjectStore, key: str, etag: str, newer: bytes, foreign: bytes
) -> Callable[[], None]:
    """What happens while a reader stalls between opening ``key`` and reading it: the
    key is replaced by ``newer``, its old file's removal reaches the disk and its
    quarantine ends, and the file is recycled and given ``foreign`` (another object's
    content) by the next write that takes it."""

    def meanwhile() -> None:
        store._put_if_match(key, newer, etag)
        checkpoint(store)
        quarantine_over(store)
        recycled = store._blanks._reused()
        assert recycled is not None
        with open(recycled, "wb") as fh:
            fh.write(foreign)

    return meanwhile


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_reader_stalled_while_its_file_is_recycled_reads_the_key_again(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """Unchecked (``_unchanged`` always True), the same stall returns the foreign bytes:
    the scenario is real, and the check is what stops it."""
    etag = asyncio.run(store.put("sessions/s", b"version-1"))
    meanwhile = stalled_reader(store, "sessions/s", etag, b"version-2", b"another object")
    target = store._file("sessions/s")
    real_open = os.open
    stalled: list[bool] = []

    def opening(path: Any, flags: int, *args: Any) -> int:
        fd = real_open(path, flags, *args)
        if path == target and flags == os.O_RDONLY and not stalled:
            stalled.append(True)
            meanwhile()
        return fd

    monkeypatch.setattr(os, "open", opening)  # the module the store calls
    if not checked:
        monkeypatch.setattr(local_files, "_unchanged", lambda opened, path: True)
    got = asyncio.run(store.get("sessions/s")).data
    assert stalled
    assert got == (b"version-2" if checked else b"another object")


def test_a_large_read_off_the_loop_whose_file_is_recycled_reads_again(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    large = b"1" * (INLINE_READ_BYTES + 10)
    etag = asyncio.run(store.put("big", large))
    meanwhile = stalled_reader(store, "big", etag, b"2" * (INLINE_READ_BYTES + 10), b"x" * 9)
    target = store._file("big")
    stalled: list[bool] = []

    def opening(path: Any, mode: str = "r", *args: Any) -> Any:
        fh = open(path, mode, *args)  # noqa: SIM115 - the reader under test closes it
        if path == target and not stalled:
            stalled.append(True)
            meanwhile()
        return fh

    monkeypatch.setattr(local_files, "open", opening, raising=False)
    assert store._get("big", None).data == b"2" * (INLINE_READ_BYTES + 10)
    assert stalled


def test_a_clock_stepped_back_leaves_fresh_objects_readable(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readers' check compares the file with itself, not with the wall clock."""
    asyncio.run(store.put("sessions/s", b"fresh"))
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)
    assert asyncio.run(store.get("sessions/s")).data == b"fresh"
    assert store._get("sessions/s", None).data == b"fresh"


def test_a_folder_at_a_key_is_neither_replaced_nor_removed(store: LocalObjectStore) -> None:
    """A swap or a rename would move a whole folder where ``os.replace`` and ``unlink``
    refused: still refused (a typed ``InvalidKey``), and nothing under it moves."""
    asyncio.run(store.put("a/b", b"inside"))
    with pytest.raises(InvalidKey):
        asyncio.run(store.delete("a"))
    with pytest.raises(InvalidKey):
        asyncio.run(store.put("a", b"over"))
    assert asyncio.run(store.get("a/b")).data == b"inside"
    assert not store._blanks._cooling


def test_a_file_named_elsewhere_too_is_never_recycled(store: LocalObjectStore) -> None:
    """A key that was a hand-made symlink to another object, or an object a backup
    hard-linked: emptying it would empty what the other name still shows."""
    asyncio.run(store.put("real", b"still published"))
    os.symlink(store._file("real"), store._file("alias"))
    asyncio.run(store.delete("alias"))
    backup = Path(store.root) / "backup-of-k"
    etag = asyncio.run(store.put("k", b"backed up"))
    os.link(store._file("k"), backup)
    asyncio.run(store.put_if_match("k", b"newer", etag=etag))
    assert not store._blanks._cooling, "a shared file was kept to be emptied"
    assert asyncio.run(store.get("real")).data == b"still published"
    assert backup.read_bytes() == b"backed up"


def test_a_delete_without_the_tmp_folder_still_removes(store: LocalObjectStore) -> None:
    asyncio.run(store.put("k", b"v"))
    refills_done(store)
    shutil.rmtree(store._tmp)
    asyncio.run(store.delete("k"))
    assert not Path(store._file("k")).exists()
