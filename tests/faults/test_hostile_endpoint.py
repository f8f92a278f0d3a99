"""A hostile notification endpoint cannot hold up or break the reconciler's sweep.

Any tenant chooses its ``callback_url``, so the far side of a delivery attempt may be
garbage, a slow drip, or a redirect into our own network. Each case runs against a real
local server (``tests.support.hostile``) inside a real sweep, and each must end as a
failed attempt with its category and a retry scheduled, while the sweep's other steps
(here: a due retry timer) still run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.harness import Env, local_env
from tests.support.hostile import HostileServer
from torpor.deliveries import DeliveryStatus
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind
from torpor.service.sweeper import Sweeper

DEADLINE_S = 1.0  # the attempt's overall deadline in these tests


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    server = HostileServer()
    yield server
    server.close()


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    extra = {"notifications": {"timeout_s": DEADLINE_S}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        yield env


async def notified_to(env: Env, url: str) -> str:
    """A finished session whose terminal notification goes to ``url``."""
    sid = await env.submit(doc="PR-H", callback_url=url)
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    return sid


@pytest.mark.parametrize(
    ("path", "category"),
    [
        ("/garbage", "protocol"),
        ("/drip", "timeout"),
        ("/redirect-local", "redirect"),
        ("/redirect-metadata", "redirect"),
    ],
)
async def test_a_hostile_answer_is_a_failed_attempt_with_a_retry(
    env: Env, hostile: HostileServer, path: str, category: str
) -> None:
    await notified_to(env, hostile.url(path))
    other = await env.submit(doc="PR-O")  # due work for another step of the same sweep
    await env.services.index.schedule(kind=TimerKind.RETRY, member=other, at=env.clock.now())
    sweeper = Sweeper(env.control)
    started = time.monotonic()
    report = await sweeper.sweep_once()
    await sweeper.deliveries.drain()
    assert time.monotonic() - started < DEADLINE_S + 3.0, "cut at the attempt's deadline"
    assert report.deliveries == 1 and report.retried == 1 and report.errors == []
    [delivery], _ = await env.services.deliveries.list("acme", status=None, cursor=None, limit=5)
    assert delivery.status is DeliveryStatus.PENDING and delivery.attempts == 1
    assert delivery.last_error is not None and delivery.last_error.startswith(f"{category}: ")
    assert delivery.next_attempt_at is not None and delivery.next_attempt_at > env.clock.now()
    at = delivery.next_attempt_at - env.clock.now()
    index = env.services.index
    assert await index.due(kind=TimerKind.DELIVER, now=env.clock.now(), limit=5) == []
    assert len(await index.due(kind=TimerKind.DELIVER, now=env.clock.now() + at, limit=5)) == 1
    assert "/internal" not in hostile.hits, "a redirect is never followed"


async def test_the_sweep_does_not_wait_on_deliveries(
    tmp_path: Path, redis_url: str, redis_prefix: str, hostile: HostileServer
) -> None:
    extra = {"notifications": {"timeout_s": 60.0}}
    async with local_env(tmp_path, redis_url, redis_prefix, extra=extra) as env:
        await notified_to(env, hostile.url("/hold"))
        sweeper = Sweeper(env.control)
        # The receiver holds its answer until released, and it is released only after the
        # sweep returned: a sweep that waited on the attempt would not return in time.
        report = await asyncio.wait_for(sweeper.sweep_once(), timeout=10)
        assert report.deliveries == 1
        hostile.release.set()
        await sweeper.deliveries.drain()
        [delivery], _ = await env.services.deliveries.list(
            "acme", status=None, cursor=None, limit=5
        )
        assert delivery.status is DeliveryStatus.DELIVERED and delivery.attempts == 1
