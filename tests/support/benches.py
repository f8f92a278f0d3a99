"""Runs a script of ``bench/`` to its end, as a person would from the shell."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(args: list[str], phrase: str, *, env: dict[str, str], timeout_s: float) -> str:
    """Run ``bench/<args[0]>`` with the rest of ``args``; it must exit 0 and print
    ``phrase`` (a figure's label or its target, which only its last report prints).
    Returns what it printed."""
    # Its own process group: a bench that overruns is stopped with everything it started
    # (the ingress bench's child, its Ray and Serve), not only the script.
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / args[0]), *args[1:]],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = bench.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGKILL)
        stdout, stderr = bench.communicate()
        raise AssertionError(
            f"{args[0]} ran past {timeout_s} s:\nstdout:\n{stdout[-2000:]}\n"
            f"stderr:\n{stderr[-4000:]}"
        ) from None
    said = f"stdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-4000:]}"
    assert bench.returncode == 0, said
    assert phrase in stdout, said
    return stdout
