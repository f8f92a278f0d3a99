"""A process readies its store before it takes traffic: the log's first segment and the
made-ahead empty files and folders exist before the first write, which then makes none
of its own (``LocalObjectStore.warm``, ``actors.wiring.warm_services``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
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
    await store.put_if_absent("queue/s_0/e_0", b"before")  # a store in use: its folders exist
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
    await store.put_if_absent("queue/s_1/e_1", b"event")
    monkeypatch.undo()
    assert made == [], "the first write took what was made ahead"
    assert log._segment is segment, "and appended to the segment put in place"
    assert (await store.get("queue/s_1/e_1")).data == b"event"
    await store.close()


async def test_a_log_readied_and_never_written_leaves_no_segment_behind(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    await store.warm()
    assert any(n.endswith(".log") for n in os.listdir(tmp_path / ".wal"))
    await store.close()
    assert not [n for n in os.listdir(tmp_path / ".wal") if n.endswith(".log")]
    reopened = LocalObjectStore(tmp_path)  # nothing to replay, nothing refused
    assert (await reopened.list("queue/")).keys == []
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


_WARMED_THEN_WAITS = """
import asyncio, sys
from storage.local_store import LocalObjectStore
store = LocalObjectStore(sys.argv[1])
asyncio.run(store.warm())
print("warm", flush=True)
sys.stdin.read()  # until killed
"""


async def test_a_process_killed_right_after_warming_leaves_nothing_the_next_must_keep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warming writes no object, but it leaves files: an empty log segment, 64 blanks,
    the lock files. A replica killed right after (``kill -9``) must not leave a segment a
    later boot chokes on, nor blanks that outlive the sweep."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with subprocess.Popen(
        [sys.executable, "-c", _WARMED_THEN_WAITS, str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
    ) as child:  # fmt: skip
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "warm"
        finally:
            child.kill()  # SIGKILL: no finalizer, no close
            child.wait(timeout=10)
    left = [p for p in (tmp_path / ".wal").glob("*.log")]
    assert left, "the killed process's readied segment is there"
    blanks_left = [n for n in os.listdir(tmp_path / ".tmp") if n.startswith("blank-")]
    assert len(blanks_left) >= 2 * blanks.HIGH

    same_boot = LocalObjectStore(tmp_path)  # the next process, before any reboot
    await same_boot.put_if_absent("queue/s_1/e_1", b"after")
    assert (await same_boot.get("queue/s_1/e_1")).data == b"after"
    await same_boot.close()

    monkeypatch.setattr(wal, "boot_id", lambda: "a-later-boot")
    rebooted = LocalObjectStore(tmp_path)  # replays the killed process's log: nothing
    assert (await rebooted.get("queue/s_1/e_1")).data == b"after"
    assert not any(p.exists() for p in left), "its segment is replayed and removed"
    await rebooted.close()
    # Its blanks are a dead process's: the sweep takes them (past its age bound).
    blanks.sweep(str(tmp_path / ".tmp"), older_than_s=0.0)
    assert not set(blanks_left) & set(os.listdir(tmp_path / ".tmp"))
