"""Runs a script of ``bench/`` to its end, as a person would from the shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(args: list[str], phrase: str, *, env: dict[str, str], timeout_s: float) -> str:
    """Run ``bench/<args[0]>`` with the rest of ``args``; it must exit 0 and print
    ``phrase`` (a figure's label or its target, which only its last report prints).
    Returns what it printed."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / args[0]), *args[1:]],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    said = f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    assert phrase in done.stdout, said
    return done.stdout
