"""kill -9 of the process attempting a delivery: the delivery is attempted again.

A child process runs one real sweep; its delivery attempt reaches a receiver that holds
the answer, and the parent kills the child with SIGKILL right there. The delivery timer
was leased, not removed, so once the lease runs out another sweeper attempts it again
(with the same ``webhook-id``, which the receiver dedups on) and it is delivered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.support.harness import local_env
from tests.support.hostile import HostileServer
from torpor.deliveries import DeliveryStatus
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.sweeper import Sweeper

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, sys
from pathlib import Path
from actors.wiring import open_services, session_runtime
from tests.support.harness import settings_for
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper

async def main() -> None:
    settings = settings_for(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
    services = open_services(settings)
    runtime = session_runtime(services, "child")
    sweeper = Sweeper(SessionService(services, InlineActivator(runtime)))
    await sweeper.sweep_once()
    print("swept", flush=True)
    await asyncio.Event().wait()  # the attempt is under way: the parent kills us here

asyncio.run(main())
"""


@pytest.fixture
def hostile() -> HostileServer:
    return HostileServer()


async def test_a_delivery_cut_by_kill_9_is_attempted_again(
    tmp_path: Path, redis_url: str, redis_prefix: str, hostile: HostileServer
) -> None:
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            sid = await env.submit(doc="PR-K", callback_url=hostile.url("/hold"))
            await env.answer(sid, {"status": "approved"})
            assert (await env.load(sid)).state is SessionState.COMPLETED
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tmp_path), redis_url, redis_prefix],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.DEVNULL,
            )
            try:
                await eventually(lambda: "/hold" in hostile.hits, what="the attempt reached us")
            finally:
                child.send_signal(signal.SIGKILL)
                await asyncio.to_thread(child.wait, 10)
            index, now = env.services.index, env.clock.now()
            assert await index.due(kind=TimerKind.DELIVER, now=now, limit=5) == [], "leased"
            sweeper = Sweeper(env.control)
            env.clock.advance(sweeper.deliveries.lease.total_seconds() + 60)
            later = env.clock.now()
            assert len(await index.due(kind=TimerKind.DELIVER, now=later, limit=5)) == 1, (
                "the timer outlived the process that took it"
            )
            hostile.release.set()  # the receiver answers from now on
            report = await sweeper.sweep_once()
            await sweeper.deliveries.drain()
            assert report.deliveries == 1, "the killed attempt's timer came due again"
            [delivery], _ = await env.services.deliveries.list(
                "acme", status=None, cursor=None, limit=5
            )
            assert delivery.status is DeliveryStatus.DELIVERED and delivery.attempts == 1
            assert hostile.hits == ["/hold", "/hold"]
    finally:
        hostile.close()
