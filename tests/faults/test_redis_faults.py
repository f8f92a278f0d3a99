"""The index paused (SIGSTOP) or flushed in the middle of an activation.

The index runs on a redis-server of the test's own; the simulated OA world stays on the
shared one. The session is held inside its first tool (after the side effect, before the
checkpoint) when the fault strikes. The activation must end, in bounded time, either done
or with a typed retryable error; afterwards the session reaches its wait with one approval
request sent, and the answer completes it: nothing lost, nothing twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.wiring import session_runtime
from storage.redis_index.connection import REDIS_TIMEOUT_S, RedisConnection
from tests.conftest import eventually
from tests.faults.conftest import DedicatedRedis
from tests.support.harness import Env, local_env
from torpor.errors import TorporError
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.service.sessions import SessionService
from torpor.service.sweeper import Sweeper

pytestmark = [pytest.mark.redis, pytest.mark.slow]

S = SessionState
GATE = "redis-fault"
# Every Redis call times out (REDIS_TIMEOUT_S); an activation makes a handful in a row.
ACTIVATION_BOUND_S = 12 * REDIS_TIMEOUT_S


class NoActivation:
    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        return None


async def held_session(env: Env, doc: str) -> tuple[str, asyncio.Task[object]]:
    """A session whose first activation is held inside ``extract_fields``."""
    idle = SessionService(env.services, NoActivation())
    sid = (await idle.submit(tenant="acme", agent="purchase", input={"doc": doc})).session_id
    activation = asyncio.create_task(
        session_runtime(env.services, "host-a").activate(sid, reason=Reason.SUBMIT)
    )

    async def holding() -> bool:
        return doc in await env.world.counts("held")

    await eventually(holding, what="the tool holds between side effect and checkpoint")
    return sid, activation


async def ends_typed(activation: asyncio.Task[object]) -> None:
    [outcome] = await asyncio.wait_for(
        asyncio.gather(activation, return_exceptions=True), timeout=ACTIVATION_BOUND_S
    )
    print("OUTCOME", repr(outcome))
    if isinstance(outcome, BaseException):
        assert isinstance(outcome, TorporError) and outcome.retryable, repr(outcome)


async def recovered(env: Env, sid: str, doc: str) -> None:
    """Sweeps (lease recovery, repair, timers) bring the session to its wait, once."""
    sweeper = Sweeper(env.control)

    async def waiting() -> bool:
        env.clock.advance(env.services.config.lease_ttl.total_seconds() + 1)
        await sweeper.sweep_once()
        snap = await env.load(sid)
        return snap.state is S.SUSPENDED and not snap.pending_outbox()

    await eventually(waiting, timeout_s=60, what="the session reaches its wait again")
    assert list(await env.world.entries("dispatch")) == [f"acme:approve:{doc}:1"]
    assert len(await env.world.entries("extract")) == 1  # one side effect per key
    assert await env.answer(sid, {"status": "approved"})
    snap = await env.load(sid)
    assert snap.state is S.COMPLETED and snap.result == {"decision": "approved", "doc": doc}


def test_every_redis_call_is_bounded(dedicated_redis: DedicatedRedis) -> None:
    # Set explicitly rather than trusting the client library's defaults (older redis-py
    # versions wait forever): a paused server must turn into IndexUnavailable, not a hang.
    pool = RedisConnection(dedicated_redis.url).client.connection_pool
    assert pool.connection_kwargs["socket_timeout"] == REDIS_TIMEOUT_S
    assert pool.connection_kwargs["socket_connect_timeout"] == REDIS_TIMEOUT_S


async def test_index_paused_mid_activation(
    tmp_path: Path, redis_url: str, redis_prefix: str, dedicated_redis: DedicatedRedis
) -> None:
    index = {"storage": {"index_url": dedicated_redis.url}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=index, hold=GATE) as env:
        sid, activation = await held_session(env, "PR-PAUSE")
        dedicated_redis.pause()
        try:
            await env.world.open_gate(GATE)
            await ends_typed(activation)
        finally:
            dedicated_redis.resume()
        await recovered(env, sid, "PR-PAUSE")


async def test_index_flushed_mid_activation(
    tmp_path: Path, redis_url: str, redis_prefix: str, dedicated_redis: DedicatedRedis
) -> None:
    index = {"storage": {"index_url": dedicated_redis.url}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=index, hold=GATE) as env:
        sid, activation = await held_session(env, "PR-FLUSH")
        dedicated_redis.flush()
        await env.world.open_gate(GATE)
        await ends_typed(activation)
        await recovered(env, sid, "PR-FLUSH")
