"""The local folder store keeps the files of replaced and removed objects to recycle
them as blanks, instead of freeing their inodes (``storage.blanks``), and its readers
never return the content a recycled file was given after they opened it."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import storage.local_store as local_store
from storage import blanks
from storage.local_store import INLINE_READ_BYTES, LocalObjectStore

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> float:
    """A short quarantine, so a test can wait it out."""
    monkeypatch.setattr(blanks, "QUARANTINE_S", 0.2)
    return 0.2


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalObjectStore]:
    made = LocalObjectStore(str(tmp_path))
    yield made
    asyncio.run(made.close())


def file_of(store: LocalObjectStore, key: str) -> int:
    """A descriptor of ``key``'s file as it is now (the caller closes it)."""
    return os.open(store._file(key), os.O_RDONLY)


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
    store: LocalObjectStore, quick: float
) -> None:
    etag = asyncio.run(store.put("sessions/s", b"v1" * 100))
    old_inode = os.stat(store._file("sessions/s")).st_ino
    asyncio.run(store.put_if_match("sessions/s", b"v2", etag=etag))
    assert store._blanks._reused() is None, "handed out while a reader may still read it"
    due = store._blanks._cooling[0][0]
    time.sleep(max(0.0, due - time.monotonic()))  # the quarantine's end, not a guess
    path = store._blanks._reused()
    assert path is not None
    status = os.stat(path)
    assert status.st_ino == old_inode and status.st_size == 0, "recycled, and emptied"


def test_blanks_come_from_recycled_files_once_their_quarantine_is_over(
    store: LocalObjectStore, quick: float
) -> None:
    etags = {i: asyncio.run(store.put(f"s/{i}", b"v1")) for i in range(40)}
    inodes = {os.stat(store._file(f"s/{i}")).st_ino for i in range(40)}
    for i in range(40):
        asyncio.run(store.put_if_match(f"s/{i}", b"v2", etag=etags[i]))
    due = store._blanks._cooling[-1][0]
    time.sleep(max(0.0, due - time.monotonic()))
    while store._blanks._making:  # a refill the writes started: let it finish first
        time.sleep(0.001)
    store._blanks._ready.clear()  # the blanks made before: the next ones are made now
    store._blanks._make()
    made = {os.stat(p).st_ino for p in store._blanks._ready}
    assert made and made <= inodes, "new inodes were made while recycled ones waited"


def test_past_the_limit_a_replaced_file_is_freed(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_MAX", 1)
    etag = asyncio.run(store.put("k", b"v1"))
    etag = asyncio.run(store.put_if_match("k", b"v2", etag=etag))
    fd = file_of(store, "k")
    try:
        asyncio.run(store.put_if_match("k", b"v3", etag=etag))
        assert os.fstat(fd).st_nlink == 0, "kept past the limit"
    finally:
        os.close(fd)
    assert len(store._blanks._cooling) == 1


def test_a_replaced_file_past_the_byte_budget_is_freed(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blanks, "KEEP_BYTES", 1000)
    etag = asyncio.run(store.put("small", b"s" * 600))
    asyncio.run(store.put_if_match("small", b"t", etag=etag))
    etag = asyncio.run(store.put("large", b"l" * 600))
    fd = file_of(store, "large")
    try:
        asyncio.run(store.put_if_match("large", b"m", etag=etag))
        assert os.fstat(fd).st_nlink == 0, "kept past the byte budget (600 + 600 > 1000)"
    finally:
        os.close(fd)
    assert len(store._blanks._cooling) == 1 and store._blanks._kept_bytes == 600


def test_where_files_cannot_be_swapped_a_replace_still_replaces(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_store, "_no_exchange", [True])
    etag = asyncio.run(store.put("k", b"v1"))
    fd = file_of(store, "k")
    try:
        asyncio.run(store.put_if_match("k", b"v2", etag=etag))
        assert os.fstat(fd).st_nlink == 0
    finally:
        os.close(fd)
    assert asyncio.run(store.get("k")).data == b"v2"
    assert not store._blanks._cooling


def stalled_reader(
    store: LocalObjectStore, key: str, etag: str, newer: bytes, foreign: bytes
) -> Callable[[], None]:
    """What happens while a reader stalls between opening ``key`` and reading it: the
    key is replaced by ``newer``, the quarantine passes, and the old file is recycled
    and given ``foreign`` (another object's content) by the next write that takes it."""

    def meanwhile() -> None:
        store._put_if_match(key, newer, etag)
        due = store._blanks._cooling[-1][0]
        time.sleep(max(0.0, due - time.monotonic()))
        time.sleep(blanks.QUARANTINE_S)  # past half a quarantine by the kernel's clock too
        recycled = store._blanks._reused()
        assert recycled is not None
        with open(recycled, "wb") as fh:
            fh.write(foreign)

    return meanwhile


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_a_reader_stalled_past_the_quarantine_reads_the_key_again(
    store: LocalObjectStore, quick: float, monkeypatch: pytest.MonkeyPatch, checked: bool
) -> None:
    """Unchecked (``_reused`` always False), the same stall returns the foreign bytes:
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
        monkeypatch.setattr(local_store, "_reused", lambda status, opened: False)
    got = asyncio.run(store.get("sessions/s")).data
    assert stalled
    assert got == (b"version-2" if checked else b"another object")


def test_a_large_read_off_the_loop_stalled_past_the_quarantine_reads_again(
    store: LocalObjectStore, quick: float, monkeypatch: pytest.MonkeyPatch
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

    monkeypatch.setattr(local_store, "open", opening, raising=False)
    assert store._get("big", None).data == b"2" * (INLINE_READ_BYTES + 10)
    assert stalled
