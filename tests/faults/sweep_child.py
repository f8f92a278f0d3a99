"""One reconciler sweep in a process of its own, killed at a named crash point:
``python -m tests.faults.sweep_child TMP REDIS_URL PREFIX NOW`` (``NOW`` in ISO form, the
sweep's clock), with ``TORPOR_CRASH_AT`` naming the point.

``killed_sweep`` runs it from a test and returns its exit code (``-SIGKILL`` when it died
there)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def killed_sweep(point: str, tmp: Path, redis_url: str, prefix: str, now: datetime) -> int:
    """Run one sweep at ``now`` in a child process armed to die at ``point``."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.sweep_child", str(tmp), redis_url, prefix,
         now.isoformat()],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TORPOR_CRASH_AT": point},
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return await asyncio.to_thread(child.wait, 60)


async def _main(tmp: str, redis_url: str, prefix: str, now: str) -> None:
    from actors.wiring import open_services, session_runtime
    from tests.support.harness import settings_for
    from torpor.clock import ManualClock
    from torpor.service.activator import InlineActivator
    from torpor.service.sessions import SessionService
    from torpor.service.sweeper import Sweeper

    settings = settings_for(Path(tmp), redis_url, prefix)
    services = open_services(settings, clock=ManualClock(datetime.fromisoformat(now)))
    runtime = session_runtime(services, "child")
    await Sweeper(SessionService(services, InlineActivator(runtime))).sweep_once()


if __name__ == "__main__":
    asyncio.run(_main(*sys.argv[1:5]))
