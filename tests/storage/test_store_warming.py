"""A process readies its store before it takes traffic: the log's first segment and the
made-ahead empty files and folders exist before the first write, which then makes none
of its own (``LocalObjectStore.warm``, ``actors.wiring.warm_services``)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from actors import wiring
from storage import blanks, wal
from storage.local_store import LocalObjectStore
from storage.memory_store import MemoryObjectStore
from tests.conftest import eventually
from torpor.settings import Settings


async def test_a_warmed_store_has_its_log_and_its_blanks_before_the_first_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalObjectStore(tmp_path)
    await store.put_if_absent("inbox/s_0/e_0", b"before")  # a store in use: its folders exist
    await store.close()
    store = LocalObjectStore(tmp_path)  # a new process's
    await store.warm()
    log = store._log
    segment = log._segment
    assert segment is not None, "the first segment is in place"
    assert len(store._blanks._ready) >= blanks.HIGH
    assert len(store._blank_folders._ready) >= blanks.HIGH

    # The spare segment is made on a thread of the log's: done before watching.
    await eventually(lambda: not log._preparing, what="the log's spare is made")
    made: list[str] = []  # any file or folder the first write would make itself
    real_open, real_mkdir = os.open, os.mkdir

    def watched_open(path: str, flags: int, *args: int) -> int:
        if flags & os.O_CREAT and not os.path.exists(path):
            made.append(path)
        return real_open(path, flags, *args)

    def watched_mkdir(path: str, *args: int) -> None:
        made.append(path)
        real_mkdir(path, *args)

    monkeypatch.setattr(os, "open", watched_open)
    monkeypatch.setattr(os, "mkdir", watched_mkdir)
    await store.put_if_absent("inbox/s_1/e_1", b"event")
    monkeypatch.undo()
    assert made == [], "the first write took what was made ahead"
    assert log._segment is segment, "and appended to the segment put in place"
    assert (await store.get("inbox/s_1/e_1")).data == b"event"
    await store.close()


async def test_a_log_readied_and_never_written_leaves_no_segment_behind(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.warm()
    assert any(n.endswith(".log") for n in os.listdir(tmp_path / ".wal"))
    await store.close()
    assert not [n for n in os.listdir(tmp_path / ".wal") if n.endswith(".log")]
    reopened = LocalObjectStore(tmp_path)  # nothing to replay, nothing refused
    assert (await reopened.list("inbox/")).keys == []
    await reopened.close()


async def test_warming_the_services_checks_conditional_writes_and_readies_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings.build(
        {"storage": {"object_store_url": f"file://{tmp_path}", "index_url": "memory://"}}
    )
    services = wiring.open_services(settings)
    monkeypatch.setattr(wiring, "_VERIFIED_STORES", set())
    real_make = blanks.Blanks._make

    def slow_make(self: blanks.Blanks) -> None:
        time.sleep(0.3)  # cold metadata: a make in a worker thread takes a while
        real_make(self)

    monkeypatch.setattr(blanks.Blanks, "_make", slow_make)
    await wiring.warm_services(services)
    assert services.store.url in wiring._VERIFIED_STORES
    store = services.store
    assert isinstance(store, LocalObjectStore)
    # The store readied first: the check's own writes took from what was made ahead and
    # left no maker running for the first request to queue behind.
    assert len(store._blanks._ready) > blanks.LOW and not store._blanks._making
    assert store._log._segment is not None
    await services.close()


async def test_a_store_that_cannot_be_readied_is_logged_and_left_to_the_first_write(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings.build(
        {"storage": {"object_store_url": "memory://", "index_url": "memory://"}}
    )
    services = wiring.open_services(settings)

    async def broken() -> None:
        raise OSError(28, "No space left on device")

    assert isinstance(services.store, MemoryObjectStore)
    monkeypatch.setattr(services.store, "warm", broken)
    with caplog.at_level(logging.WARNING, logger="actors.wiring"):
        await wiring.warm_services(services)  # never raises: the replica still starts
    assert "could not ready the object store" in caplog.text
    await services.close()


def test_wal_ready_is_once(tmp_path: Path) -> None:
    log = wal.WriteAheadLog(str(tmp_path / ".wal"))
    log.ready()
    first = log._segment
    log.ready()
    assert first is not None and log._segment is first
    log.close()
