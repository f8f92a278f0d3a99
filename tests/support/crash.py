"""Run a piece of torpor in a real child process and kill it -9 at a named crash point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_killed_at(point: str, code: str, *args: str, timeout_s: float = 120.0) -> None:
    """Run ``code`` (a Python program; ``sys.argv[1:]`` are ``args``) in a fresh interpreter
    with ``TORPOR_CRASH_AT=point`` and assert that it died there, by SIGKILL."""
    env = {**os.environ, "TORPOR_CRASH_AT": point, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, (
        f"expected a SIGKILL at {point!r}, the child exited {done.returncode}:\n"
        f"{done.stderr.decode(errors='replace')[-2000:]}"
    )
