"""What a killed process left in the local folder store's ``.tmp`` folder (the empty
files and folders it made ahead, a write it never finished) is removed when a store
next opens the folder; what a running process made, and anything young, stays."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from storage import blanks
from storage.blanks import sweep
from storage.local_store import LocalObjectStore
from tests.conftest import eventually

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
WRITER = """
import asyncio, sys, time
from storage.local_store import LocalObjectStore
store = LocalObjectStore(sys.argv[1])
asyncio.run(store.put("queue/s/e", b"x"))  # writes: files and folders are made ahead
print("written", flush=True)
time.sleep(600)
"""


def aged(folder: Path, by_s: float) -> None:
    """Every entry of ``folder`` made ``by_s`` seconds older."""
    for entry in folder.iterdir():
        at = entry.stat().st_mtime - by_s
        os.utime(entry, (at, at))


def made_by(folder: Path, pid: int) -> set[str]:
    return {
        p.name for p in folder.iterdir() if p.name.startswith((f"blank-{pid}-", f"blank-d-{pid}-"))
    }


def test_a_killed_writers_blanks_and_half_done_writes_are_swept_at_the_next_open(
    tmp_path: Path,
) -> None:
    tmp = tmp_path / ".tmp"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == b"written\n"
        asyncio.run(
            eventually(
                lambda: len(made_by(tmp, writer.pid)) >= 2 * blanks.LOW,
                what="the writer made files and folders ahead",
            )
        )
    finally:
        writer.send_signal(signal.SIGKILL)  # killed with its blanks made, never used
        writer.communicate()
    left = made_by(tmp, writer.pid)
    assert left, "a killed writer leaves its blanks"
    (tmp / "0123456789abcdef01234567").write_bytes(b"half")  # a write it never finished

    running = LocalObjectStore(str(tmp_path))  # a live process's blanks: this one's
    asyncio.run(running.put("queue/s/f", b"x"))
    asyncio.run(
        eventually(lambda: made_by(tmp, os.getpid()), what="this process made blanks ahead")
    )
    ours = made_by(tmp, os.getpid())
    aged(tmp, by_s=2 * blanks.STALE_S)
    (tmp / "fedcba9876543210fedcba98").write_bytes(b"in flight")  # young: a write going on

    LocalObjectStore(str(tmp_path))  # opening the folder sweeps it, off the caller's path
    asyncio.run(eventually(lambda: not made_by(tmp, writer.pid), what="the dead blanks go"))
    names = {p.name for p in tmp.iterdir()}
    assert "0123456789abcdef01234567" not in names, "an old half-done write is removed"
    assert "fedcba9876543210fedcba98" in names, "a young temporary file stays"
    assert ours <= names, "a running process's blanks stay, however old"


def test_young_leftovers_of_a_dead_process_stay(tmp_path: Path) -> None:
    """Age is the guard for a process whose id means nothing here (another pid
    namespace): nothing younger than ``STALE_S`` is removed."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    (tmp_path / f"blank-{pid}-00ff").write_bytes(b"")
    (tmp_path / f"blank-d-{pid}-00fe").mkdir()
    (tmp_path / "blank-0123456789abcdef01234567").write_bytes(b"")  # an older release's
    assert sweep(str(tmp_path)) == 0
    aged(tmp_path, by_s=2 * blanks.STALE_S)
    assert sweep(str(tmp_path)) == 3
    assert not list(tmp_path.iterdir())


def test_a_blank_of_a_reused_pid_is_swept_by_its_makers_start_time(tmp_path: Path) -> None:
    """A container's app is pid 1 after every restart: a killed run's blanks (and the
    old files it kept to recycle) carry its start time, so a new process with the same
    pid does not keep them alive."""
    pid = os.getpid()
    ours = blanks.Blanks(str(tmp_path), submit=lambda make: make()).name()
    Path(ours).write_bytes(b"kept")
    (tmp_path / f"blank-{pid}-1-00ff").write_bytes(b"of an earlier run")
    aged(tmp_path, by_s=2 * blanks.STALE_S)
    assert sweep(str(tmp_path)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(ours).name]
