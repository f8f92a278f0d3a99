"""kill -9 of the session process at each named crash point, then recovery.

Each test starts a real session process (``tests/faults/session_driver.py``) with
``TORPOR_CRASH_AT`` naming one point of ``torpor.faults.CrashPoint``, and checks that it
died by SIGKILL there. The test process then plays the reconciler: it sweeps until the
dead holder's lease expires (by the Redis server's clock) and the session is recovered
from its last checkpoint. After each, the invariants: the session ends terminal or waiting
as it should, at most one side effect per idempotency key (the far side applies a key
once; the calls are counted too), no accepted event lost, one request per action key,
and every commit after the crash carries a fence above the dead holder's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from actors.wiring import open_services, session_runtime
from storage import keys
from tests.faults.index_loss import flush_index
from tests.support.harness import settings_for
from tests.support.receiver import Receiver
from tests.support.tools import World
from torpor.clock import SystemClock
from torpor.deliveries import DeliveryStatus
from torpor.errors import ObjectNotFound
from torpor.faults import ENV, CrashPoint
from torpor.ids import event_key
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxKind, SessionSnapshot
from torpor.ports import TimerKind
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# A short lease, so the dead holder's expires quickly (decided by the Redis server's clock).
FAST = {"lease": {"ttl_s": 1.0, "heartbeat_s": 0.2}, "reconciler": {"interval_s": 0.2}}
START_KEY = "acme:approve:PR-1:1"
UNDO_KEY = START_KEY + ":compensate"
S = SessionState


@dataclass
class Crash:
    tmp: Path
    redis_url: str
    prefix: str
    approval: dict[str, Any]
    services: Services
    control: SessionService
    sweeper: Sweeper
    world: World

    async def kill_at(self, point: str, action: str, **spec: Any) -> str:
        """Run the driver with ``point`` armed; it must die by SIGKILL there. Returns the
        session id (the only session in this test's store)."""
        code, out = await self.drive(action, crash_at=point, **spec)
        assert code == -signal.SIGKILL, f"the driver did not die at {point}: {code}\n{out}"
        return await self.only_session()

    async def drive(self, action: str, *, crash_at: str = "", **spec: Any) -> tuple[int, str]:
        payload = {
            "tmp": str(self.tmp),
            "redis_url": self.redis_url,
            "prefix": self.prefix,
            "action": action,
            "approval": self.approval,
            "extra": FAST,
            **spec,
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.faults.session_driver",
            json.dumps(payload),
            cwd=ROOT,
            env={**os.environ, ENV: crash_at},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace")

    async def only_session(self) -> str:
        ids = [sid async for page in self.services.snapshots.session_ids() for sid in page]
        assert len(ids) == 1, ids
        return ids[0]

    async def load(self, sid: str) -> SessionSnapshot:
        return await self.services.snapshots.load(sid)

    async def recover(
        self, sid: str, done: Callable[[SessionSnapshot], bool], *, timeout_s: float = 30
    ) -> SessionSnapshot:
        """Sweep as the reconciler does until ``done(snapshot)``: the dead holder's lease
        must expire first, so nothing recovers the session before that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.sweeper.sweep_once()
            snap = await self.load(sid)
            if done(snap):
                return snap
            assert loop.time() < deadline, f"not recovered: {snap.state} {snap.outbox}"
            await asyncio.sleep(0.1)


@pytest.fixture
async def make_crash(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> AsyncIterator[Callable[..., Awaitable[Crash]]]:
    opened: list[Crash] = []

    async def make(**approval: Any) -> Crash:
        settings = settings_for(tmp_path, redis_url, redis_prefix, extra=FAST, **approval)
        services = open_services(settings, clock=SystemClock())
        control = SessionService(services, InlineActivator(session_runtime(services, "rescuer")))
        crash = Crash(
            tmp_path,
            redis_url,
            redis_prefix,
            approval,
            services,
            control,
            Sweeper(control),
            World(redis_url, redis_prefix),
        )
        opened.append(crash)
        return crash

    yield make
    for crash in opened:
        await crash.world.close()
        await crash.services.close()


async def assert_one_request_per_key(world: World, kind: str, key: str, calls: int) -> None:
    """The far side applied the key once (one entry) and was called ``calls`` times."""
    assert list(await world.entries(kind)) == [key]
    assert await world.counts(kind) == {key: calls}


async def assert_resolvable(crash: Crash, snap: SessionSnapshot) -> None:
    [wait] = snap.waits
    binding = await crash.services.index.resolve(
        tenant="acme", now=crash.services.clock.now(), correlation_id=wait.correlation_id
    )
    assert binding is not None and binding.session_id == snap.session_id


def waiting_and_sent(snap: SessionSnapshot) -> bool:
    return snap.state is S.SUSPENDED and not snap.pending_outbox()


async def test_kill_mid_sync_tool_reruns_it_under_the_same_key(make_crash: Any) -> None:
    crash: Crash = await make_crash()
    sid = await crash.kill_at(CrashPoint.SYNC_TOOL_RAN, "submit")
    dead = await crash.load(sid)
    assert dead.state is S.RUNNING and dead.tool_log == {}, "the tool's result was not saved"
    [extract_key] = await crash.world.entries("extract")
    snap = await crash.recover(sid, waiting_and_sent)
    assert snap.lease_fence > dead.lease_fence
    # The tool ran again with the same key: one effect, two calls; then one request.
    await assert_one_request_per_key(crash.world, "extract", extract_key, 2)
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)
    await assert_resolvable(crash, snap)


async def test_kill_between_the_suspend_commit_and_the_dispatch(make_crash: Any) -> None:
    crash: Crash = await make_crash()
    sid = await crash.kill_at(CrashPoint.SUSPEND_COMMITTED, "submit")
    dead = await crash.load(sid)
    assert dead.state is S.SUSPENDED and [e.kind for e in dead.pending_outbox()] == ["start"]
    [wait] = dead.waits
    assert (
        await crash.services.index.resolve(
            tenant="acme", now=crash.services.clock.now(), correlation_id=wait.correlation_id
        )
        is None
    ), "died before binding"
    assert await crash.world.counts("dispatch") == {}
    snap = await crash.recover(sid, waiting_and_sent)
    assert snap.lease_fence > dead.lease_fence and snap.waits == dead.waits
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)
    await assert_resolvable(crash, snap)


async def test_kill_after_bind_before_dispatch(make_crash: Any) -> None:
    crash: Crash = await make_crash()
    sid = await crash.kill_at(CrashPoint.WAITS_BOUND, "submit")
    dead = await crash.load(sid)
    assert dead.state is S.SUSPENDED and dead.pending_outbox()
    await assert_resolvable(crash, dead)
    assert await crash.world.counts("dispatch") == {}
    snap = await crash.recover(sid, waiting_and_sent)
    assert snap.lease_fence > dead.lease_fence
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)


@pytest.mark.parametrize(
    ("point", "calls"),
    [(CrashPoint.SUSPEND_COMMITTED, 1), (CrashPoint.WAITS_BOUND, 1), (CrashPoint.START_SENT, 2)],
)
async def test_a_suspend_killed_before_its_request_is_recorded_then_the_index_lost(
    make_crash: Any, point: CrashPoint, calls: int
) -> None:
    """The process dies between the suspend's commit and the commit that records its
    request as sent, and then the index is lost too, the dead holder's lease with it:
    repair, not the lease's expiry, brings the session back. The wait's durable record
    and business-key pointer exist afterwards (died before binding: repair or the
    activation it asks for wrote them), the request went out under its one key, and the
    rebuilt index routes the wait."""
    crash: Crash = await make_crash()
    sid = await crash.kill_at(point, "submit")
    dead = await crash.load(sid)
    assert dead.state is S.SUSPENDED and [e.kind for e in dead.pending_outbox()] == ["start"]
    [wait] = dead.waits
    store = crash.services.store
    if point is CrashPoint.SUSPEND_COMMITTED:  # nothing of the binding was written
        for key in (
            keys.correlation(wait.correlation_id),
            keys.correlation_ref(sid, wait.correlation_id),
        ):
            with pytest.raises(ObjectNotFound):
                await store.get(key)
    assert await flush_index(crash.redis_url, crash.prefix) > 0
    snap = await crash.recover(sid, waiting_and_sent, timeout_s=10)
    assert snap.lease_fence > dead.lease_fence and snap.waits == dead.waits
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, calls)
    await assert_resolvable(crash, snap)
    await store.get(keys.correlation(wait.correlation_id))
    await store.get(keys.correlation_ref(sid, wait.correlation_id))
    assert wait.business_key is not None
    target = await crash.services.correlations.business_key_target(
        tenant="acme", business_key=wait.business_key
    )
    assert target == wait.correlation_id


async def test_kill_after_dispatch_before_its_status_commit(make_crash: Any) -> None:
    crash: Crash = await make_crash()
    sid = await crash.kill_at(CrashPoint.START_SENT, "submit")
    dead = await crash.load(sid)
    assert dead.state is S.SUSPENDED and dead.pending_outbox(), "the send was not recorded"
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)
    snap = await crash.recover(sid, waiting_and_sent)
    assert snap.lease_fence > dead.lease_fence
    [start] = snap.outbox
    assert start.status is DispatchStatus.DISPATCHED
    # Sent again under the same key: the far side applied it once.
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 2)


async def test_a_cancel_after_a_kill_between_send_and_status_sends_nothing_and_undoes(
    make_crash: Any,
) -> None:
    """Killed after its request went out, before the send was recorded; the client
    cancels before any recovery. The recovering activation used to send the owed request
    again before it saw the cancel; now the cancel comes first: the request is not sent
    again, and it is undone (it reached the OA system, though never marked so)."""
    crash: Crash = await make_crash()
    sid = await crash.kill_at(CrashPoint.START_SENT, "submit")
    assert (await crash.load(sid)).pending_outbox(), "the send was not recorded"
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)
    await crash.control.cancel(sid)  # the dead holder's lease: nothing runs it yet

    def cancelled(snap: SessionSnapshot) -> bool:
        return snap.state is S.CANCELLED and not snap.pending_outbox()

    snap = await crash.recover(sid, cancelled)
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)
    await assert_one_request_per_key(crash.world, "compensate", UNDO_KEY, 1)
    [start] = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert start.status is DispatchStatus.FAILED and "not sent" in (start.last_error or "")


async def test_kill_after_the_terminal_commit_mid_compensation(make_crash: Any) -> None:
    crash: Crash = await make_crash()
    code, out = await crash.drive("submit")  # no crash: suspended, request sent
    assert code == 0, out
    sid = await crash.only_session()
    assert (await crash.load(sid)).state is S.SUSPENDED
    await crash.kill_at(CrashPoint.COMPENSATE_SENT, "cancel", session_id=sid)
    dead = await crash.load(sid)
    assert dead.state is S.CANCELLED and dead.waits == []
    [undo] = dead.pending_outbox()
    assert undo.kind is OutboxKind.COMPENSATE
    cancel_key = event_key("torpor", "cancel")
    assert cancel_key in dead.processed_events
    await assert_one_request_per_key(crash.world, "compensate", UNDO_KEY, 1)

    def compensated(snap: SessionSnapshot) -> bool:
        return not snap.pending_outbox()

    snap = await crash.recover(sid, compensated)
    assert snap.state is S.CANCELLED and cancel_key in snap.processed_events
    assert snap.lease_fence > dead.lease_fence
    await assert_one_request_per_key(crash.world, "compensate", UNDO_KEY, 2)
    await assert_one_request_per_key(crash.world, "dispatch", START_KEY, 1)


async def test_kill_after_a_failed_start_is_committed_still_tells_the_agent(
    make_crash: Any,
) -> None:
    crash: Crash = await make_crash(fail_dispatch=True)
    sid = await crash.kill_at(CrashPoint.START_FAILED, "submit")
    dead = await crash.load(sid)
    [start] = dead.outbox
    assert dead.state is S.SUSPENDED and start.status is DispatchStatus.FAILED
    assert await crash.services.inbox.pending(sid, processed=set()) == [], "nobody told it"
    snap = await crash.recover(sid, lambda s: s.terminal)
    # The agent saw the failure as the tool's answer and took its error branch.
    assert snap.state is S.COMPLETED and snap.result == {"decision": "error", "doc": "PR-1"}
    [wait] = dead.waits
    failed_key = event_key("torpor", f"dispatch-failed:{wait.correlation_id}")
    assert snap.waits == [] and failed_key in snap.processed_events
    assert await crash.world.counts("dispatch") == {}


async def test_kill_after_a_notice_is_stored_before_its_timer_still_delivers_it_once(
    make_crash: Any,
) -> None:
    """Killed between storing the cancel notice's delivery and arming its timer: nothing
    would ever attempt it (the delivery worker finds work by its timers). The reconciler
    gives it its timer back (the recovered session's outbox replay, and the repair through
    the pending-delivery marker, each do), and it is delivered once."""
    hook = Receiver(script=[200])
    try:
        crash: Crash = await make_crash()
        code, out = await crash.drive("submit", callback_url=hook.url)
        assert code == 0, out
        sid = await crash.only_session()
        await crash.kill_at(CrashPoint.DELIVERY_CREATED, "cancel", session_id=sid)
        dead = await crash.load(sid)
        assert dead.state is S.CANCELLED
        assert any(e.kind is OutboxKind.NOTIFY for e in dead.pending_outbox())
        [stored], _ = await crash.services.deliveries.list(
            "acme", status=None, cursor=None, limit=5
        )
        assert stored.status is DeliveryStatus.PENDING and hook.received == []
        now = crash.services.clock.now()
        assert await crash.services.index.due(kind=TimerKind.DELIVER, now=now, limit=5) == []

        def drained_and_delivered(snap: SessionSnapshot) -> bool:
            return not snap.pending_outbox() and len(hook.received) > 0

        await crash.recover(sid, drained_and_delivered)
        await crash.sweeper.deliveries.drain()
        await crash.sweeper.sweep_once()
        await crash.sweeper.deliveries.drain()
        delivered = await crash.services.deliveries.get("acme", stored.delivery_id)
        assert delivered.status is DeliveryStatus.DELIVERED and delivered.attempts == 1
        assert len(hook.received) == 1, "once"
    finally:
        hook.close()
