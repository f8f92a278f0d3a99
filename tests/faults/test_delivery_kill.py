"""kill -9 of the process attempting or resending a delivery: the delivery is attempted again.

A child process runs one real sweep; its delivery attempt reaches a receiver that holds
the answer, and the parent kills the child with SIGKILL right there. The delivery timer
was leased, not removed, so once the lease runs out another sweeper attempts it again
(with the same ``webhook-id``, which the receiver dedups on) and it is delivered.

A child process resends a dead letter and dies (crash point ``delivery.resent``) once
the delivery is pending again: the sweep still attempts it.
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
from tests.support.receiver import Receiver
from torpor.deliveries import DeliveryStatus
from torpor.faults import CrashPoint
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.deliveries import DeliveryWorker
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


RESEND_CHILD = """
import asyncio, sys
from pathlib import Path
from actors.wiring import open_services
from tests.support.harness import settings_for
from torpor.service.deliveries import DeliveryWorker

async def main() -> None:
    services = open_services(settings_for(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
    await DeliveryWorker(services).resend("acme", sys.argv[4], now=services.clock.now())

asyncio.run(main())
"""


async def test_a_resend_cut_by_kill_9_is_still_attempted(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Killed after the delivery turned pending and before its timer was set, a resend
    left a pending delivery that nothing attempted, and a second resend was refused
    (409: it is pending)."""
    hook = Receiver(script=[500])
    try:
        async with local_env(tmp_path, redis_url, redis_prefix) as env:
            sid = await env.submit(doc="PR-R", callback_url=hook.url)
            await env.answer(sid, {"status": "approved"})
            worker = DeliveryWorker(env.services)
            for _ in range(8):  # the first try and seven retries, all 500
                await worker.due(env.clock.now())
                env.clock.advance(13 * 3600)
            store = env.services.deliveries
            [dead], _ = await store.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=5)
            args = [str(tmp_path), redis_url, redis_prefix, dead.delivery_id]
            child = subprocess.Popen(
                [sys.executable, "-c", RESEND_CHILD, *args],
                cwd=ROOT,
                env={
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "TORPOR_CRASH_AT": CrashPoint.DELIVERY_RESENT,
                },
                stdout=subprocess.DEVNULL,
            )
            assert await asyncio.to_thread(child.wait, 60) == -signal.SIGKILL
            assert (await store.get("acme", dead.delivery_id)).status is DeliveryStatus.PENDING
            hook.script = [200]
            assert await worker.due(env.clock.now()) == 1, "the resent delivery is attempted"
            delivered = await store.get("acme", dead.delivery_id)
            assert delivered.status is DeliveryStatus.DELIVERED
            assert len(hook.received) == 9
    finally:
        hook.close()
