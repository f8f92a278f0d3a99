"""The reconciler keeps sweeping after its process is killed, without anyone's help.

Ray restarts a dead actor (``max_restarts=-1``) by running ``__init__`` again, nothing
else; the sweep loop must start from there. The test kills the reconciler's real process
with SIGKILL and watches a new incarnation sweep (its own counter, and the last-sweep
time it records in the index) while nobody calls ``start``.
"""

from __future__ import annotations

import os
import signal
from datetime import datetime
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.reconciler import ensure_reconciler
from tests.conftest import eventually

pytestmark = pytest.mark.slow


def status(handle: Any) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = ray.get(handle.status.remote(), timeout=5)
    except (GetTimeoutError, RayActorError):  # restarting
        return None
    return found


async def test_sweeps_resume_after_the_reconciler_process_is_killed(make_ray_env: Any) -> None:
    async with make_ray_env() as env:
        handle = ensure_reconciler(env.settings)
        index = env.services.index

        def swept(n: int) -> bool:
            found = status(handle)
            return found is not None and found["sweeps"] >= n

        await eventually(lambda: swept(1), timeout_s=60, what="the first sweep")
        pid = ray.get(handle.pid.remote(), timeout=10)
        os.kill(pid, signal.SIGKILL)
        killed_at = datetime.now().astimezone()

        def new_incarnation() -> bool:
            try:
                return bool(ray.get(handle.pid.remote(), timeout=5) != pid)
            except (GetTimeoutError, RayActorError):
                return False

        await eventually(new_incarnation, timeout_s=90, interval_s=0.5, what="Ray restarted it")
        # Nobody calls start(): the restarted actor sweeps by itself.
        await eventually(lambda: swept(2), timeout_s=60, what="sweeps in the new process")

        async def recorded_after_kill() -> bool:
            last = await index.last_sweep()
            return last is not None and last > killed_at

        await eventually(recorded_after_kill, timeout_s=30, what="a complete sweep recorded")
        ray.kill(handle, no_restart=True)
