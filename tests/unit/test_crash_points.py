"""Crash points armed once: only the first process to reach one dies there (a process
started again with the same environment, as Ray restarts a pool host, goes on)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from torpor.faults import ENV, ONCE_ENV

ROOT = Path(__file__).resolve().parents[2]
REACH = "from torpor.faults import crash_point; crash_point('pool.taken.recover'); print('on')"


def reach(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", REACH],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_armed_point_kills_every_process_that_reaches_it() -> None:
    for _ in range(2):
        assert reach({ENV: "pool.taken.recover"}).returncode == -signal.SIGKILL


def test_a_point_armed_once_kills_only_the_first(tmp_path: Path) -> None:
    once = {ENV: "pool.taken.recover", ONCE_ENV: str(tmp_path)}
    assert reach(once).returncode == -signal.SIGKILL
    again = reach(once)
    assert again.returncode == 0 and again.stdout.strip() == "on", again.stderr
    assert (tmp_path / "pool.taken.recover").exists()


def test_a_point_not_armed_does_nothing(tmp_path: Path) -> None:
    done = reach({ENV: "pool.taken.event", ONCE_ENV: str(tmp_path)})
    assert done.returncode == 0 and list(tmp_path.iterdir()) == []
