"""Clocks skewed per component: the gateway, the session runtime and the sweeper each read
their own clock, offset by up to two minutes from the others.

Three sets of services share one object store and one index, each with its own clock.
Whatever the offsets: a wait does not time out early, a live holder's lease is not taken
by a sweeper whose clock runs ahead, and an event stamped by a gateway clock ahead of or
behind the runtime's is applied.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from actors.wiring import open_services, session_runtime
from tests.conftest import eventually
from tests.support.harness import settings_for
from tests.support.tools import World
from torpor.clock import ManualClock
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.gateway import WebhookGateway
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper
from torpor.webhooks.signing import Scheme, sign

pytestmark = [pytest.mark.redis, pytest.mark.slow]

S = SessionState
SKEW = timedelta(minutes=2)
SECRET = "s" * 64
GATE = "skew"
SOURCES = {
    "sources": {
        "oa": {
            "tenant": "acme",
            "scheme": "torpor",
            "secrets": [SECRET],
            "mapping": {
                "event_id_path": "id",
                "default_type": "oa.approval.decided",
                "correlation_id_path": "correlationId",
            },
        }
    }
}


class SkewedClock:
    """Another process's clock: the shared true time plus a fixed offset."""

    def __init__(self, truth: ManualClock, offset: timedelta) -> None:
        self.truth, self.offset = truth, offset

    def now(self) -> datetime:
        return self.truth.now() + self.offset


@dataclass
class Cluster:
    truth: ManualClock
    runtime: Services
    gateway: WebhookGateway
    sweeper: Sweeper
    sessions: SessionService  # the runtime side's service (inline activations)
    world: World


@asynccontextmanager
async def cluster(
    tmp: Path, redis_url: str, prefix: str, *, gateway: timedelta, sweeper: timedelta, **kw: object
) -> AsyncIterator[Cluster]:
    settings = settings_for(
        tmp,
        redis_url,
        prefix,
        extra={**SOURCES, "lease": {"ttl_s": 30.0, "heartbeat_s": 0.2}},
        **kw,
    )
    truth = ManualClock()
    opened = [open_services(settings, clock=SkewedClock(truth, off)) for off in
              (timedelta(0), gateway, sweeper)]  # fmt: skip
    runtime, at_gateway, at_sweeper = opened
    inline = InlineActivator(session_runtime(runtime, "runtime"))
    world = World(redis_url, prefix)
    try:
        yield Cluster(
            truth,
            runtime,
            WebhookGateway(SessionService(at_gateway, inline)),
            Sweeper(SessionService(at_sweeper, InlineActivator(session_runtime(at_sweeper, "sw")))),
            SessionService(runtime, inline),
            world,
        )
    finally:
        await world.close()
        for services in opened:
            await services.close()


SKEWS = [(SKEW, -SKEW), (-SKEW, SKEW)]


@pytest.mark.parametrize(("gateway", "sweeper"), SKEWS, ids=["gw-ahead", "sweeper-ahead"])
async def test_no_wrong_timeout_and_no_event_dropped(
    tmp_path: Path, redis_url: str, redis_prefix: str, gateway: timedelta, sweeper: timedelta
) -> None:
    async with cluster(
        tmp_path, redis_url, redis_prefix, gateway=gateway, sweeper=sweeper, sla_s=600
    ) as c:
        sid = await c.sessions.submit(tenant="acme", agent="purchase", input={"doc": "SK-1"})
        snap = await c.runtime.snapshots.load(sid.session_id)
        assert snap.state is S.SUSPENDED
        # Eight of the SLA's ten minutes pass: no clock, however skewed, may call it late.
        c.truth.advance(8 * 60 - 1)
        await c.sweeper.sweep_once()
        assert (await c.runtime.snapshots.load(sid.session_id)).state is S.SUSPENDED
        body = json.dumps(
            {"id": "ans-1", "correlationId": snap.waits[0].correlation_id, "status": "approved"}
        ).encode()
        headers = {
            **sign(Scheme.TORPOR, body, SECRET, now=c.truth.now()),  # the sender's true time
            "Content-Type": "application/json",
        }
        result = await c.gateway.receive("oa", body, headers, now=c.gateway.services.clock.now())
        assert result.status == 202
        await c.gateway.sessions.drain()

        async def applied() -> bool:
            await c.sweeper.sweep_once()
            return (await c.runtime.snapshots.load(sid.session_id)).state is S.COMPLETED

        await eventually(applied, what="the answer stamped by a skewed gateway is applied")
        done = await c.runtime.snapshots.load(sid.session_id)
        assert done.result == {"decision": "approved", "doc": "SK-1"}


@pytest.mark.parametrize(
    ("gateway", "sweeper"),
    [(SKEW, -SKEW), (-SKEW, SKEW)],
    ids=["sweeper-behind", "sweeper-ahead"],
)
async def test_no_lease_taken_from_a_live_holder(
    tmp_path: Path, redis_url: str, redis_prefix: str, gateway: timedelta, sweeper: timedelta
) -> None:
    async with cluster(
        tmp_path, redis_url, redis_prefix, gateway=gateway, sweeper=sweeper, hold=GATE
    ) as c:
        idle = SessionService(c.runtime, NoActivation())
        sid = (await idle.submit(tenant="acme", agent="purchase", input={"doc": "SK-2"})).session_id
        holder = session_runtime(c.runtime, "live-holder")
        running = asyncio.create_task(holder.activate(sid, reason=Reason.SUBMIT))

        async def holding() -> bool:
            return "SK-2" in await c.world.counts("held")

        await eventually(holding, what="the live holder runs the tool")
        # The holder heartbeats on its own clock; the sweeper looks with one two minutes off.
        sweep = asyncio.create_task(c.sweeper.sweep_once())

        async def settled() -> bool:  # the sweep is done, or it got into the tool too
            return sweep.done() or (await c.world.counts("held"))["SK-2"] >= 2

        await eventually(settled, what="the sweep passes the live session by")
        await c.world.open_gate(GATE)
        report = await asyncio.wait_for(sweep, timeout=60)
        await c.sweeper.sessions.drain()
        assert not report.errors
        await asyncio.wait_for(running, timeout=60)
        snap = await c.runtime.snapshots.load(sid)
        assert snap.state is S.SUSPENDED
        # One activation ran the tool: nobody else took the lease and ran it again.
        assert list((await c.world.counts("extract")).values()) == [1]
        assert list(await c.world.counts("dispatch")) == ["acme:approve:SK-2:1"]


class NoActivation:
    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        return None
