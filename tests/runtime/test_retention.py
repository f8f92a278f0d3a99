"""Retention: a session that ended longer ago than ``storage.retention_s`` is deleted
with every record of its own, by the sweep, and nothing a window still needs goes early.

Real Redis for the index, a local folder for objects, a manual clock for the 30 days."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from storage import keys
from tests.support.harness import Env, local_env
from tests.support.receiver import Receiver
from torpor.errors import ConfigError, SessionNotFound
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState
from torpor.service.sweeper import Sweeper
from torpor.settings import Settings

DAY = 24 * 3600.0


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        yield env


async def every_key(env: Env) -> list[str]:
    found: list[str] = []
    token: str | None = None
    while True:
        page = await env.services.store.list("", start_after=token)
        found += page.keys
        if page.next_token is None:
            return found
        token = page.next_token


async def ended_session(env: Env, hook: Receiver) -> tuple[str, str]:
    """A completed session whose notification was delivered, with a late webhook answer
    (its replay marker too) in its inbox. Returns (session id, correlation id)."""
    sid = await env.submit(doc="PR-R", callback_url=hook.url)
    cid = (await env.load(sid)).waits[0].correlation_id
    await env.answer(sid, {"status": "approved"})
    assert (await env.load(sid)).state is SessionState.COMPLETED
    late = InboxEvent.new(
        kind=EventKind.CALLBACK,
        session_id=sid,
        source="oa",
        event_id="evt-late",
        type="oa.approval.decided",
        received_at=env.clock.now(),
        correlation_id=cid,
    ).model_copy(update={"content_digest": "d" * 64})
    await env.control.deliver(late)
    await env.services.inbox.remember_accepted(source="oa", content_digest="d" * 64)
    swept = Sweeper(env.control)
    await swept.sweep_once()
    await swept.deliveries.drain()
    assert len(hook.received) == 1
    return sid, cid


async def test_an_ended_session_and_all_its_records_go_after_the_retention_period(
    env: Env,
) -> None:
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        sleeping = await env.submit(doc="PR-S")  # a live session: never touched
        mine = [k for k in await every_key(env) if sid in k or cid in k]
        assert {keys.snapshot(sid), keys.correlation(cid)} <= set(mine)
        assert any(k.startswith(keys.inbox_prefix(sid)) for k in mine)
        [ref] = [k for k in mine if k.startswith(keys.refs_prefix(sid) + "d/")]
        delivery_id = ref.rsplit("/", 1)[1]
        assert keys.delivery("acme", delivery_id) in await every_key(env)

        env.clock.advance(29 * DAY)
        assert (await Sweeper(env.control).sweep_once()).purged == 0
        assert (await env.load(sid)).state is SessionState.COMPLETED

        env.clock.advance(2 * DAY)
        report = await Sweeper(env.control).sweep_once()
        assert report.purged == 1 and report.errors == []
        with pytest.raises(SessionNotFound):
            await env.load(sid)
        left = [k for k in await every_key(env) if sid in k or cid in k or delivery_id in k]
        assert left == []
        assert not await env.services.inbox.was_accepted(source="oa", content_digest="d" * 64)
        assert await env.services.correlations.lookup(cid) is None
        assert await env.services.index.session_states([sid]) == {}
        assert (await env.load(sleeping)).state is SessionState.SUSPENDED
        assert await env.services.index.session_states([sleeping]) != {}
    finally:
        hook.close()


async def test_a_webhook_inside_the_replay_window_keeps_its_session(env: Env) -> None:
    hook = Receiver()
    try:
        sid, cid = await ended_session(env, hook)
        env.clock.advance(31 * DAY)
        recent = InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=sid,
            source="oa",
            event_id="evt-recent",
            type="oa.approval.decided",
            received_at=env.clock.now() - timedelta(hours=1),
            correlation_id=cid,
        ).model_copy(update={"content_digest": "e" * 64})
        await env.services.inbox.deliver(recent)
        await env.services.inbox.remember_accepted(source="oa", content_digest="e" * 64)
        retention = env.services.retention
        assert retention is not None
        windows = timedelta(hours=24)
        keep = timedelta(days=30)
        now = env.clock.now()
        report = await retention.sweep(now=now, keep=keep, windows=windows, limit=10)
        assert report.purged == [] and report.kept == 1
        assert await env.services.inbox.was_accepted(source="oa", content_digest="e" * 64)

        later = now + timedelta(hours=24)
        report = await retention.sweep(now=later, keep=keep, windows=windows, limit=10)
        assert report.purged == [("acme", sid)]
        assert not await env.services.inbox.was_accepted(source="oa", content_digest="e" * 64)
    finally:
        hook.close()


async def test_a_delivery_still_being_attempted_keeps_its_session(env: Env) -> None:
    dead = Receiver()
    url = dead.url
    dead.close()  # nobody answers: the delivery stays pending, with retries ahead
    sid = await env.submit(doc="PR-D", callback_url=url)
    await env.answer(sid, {"status": "approved"})
    retention = env.services.retention
    assert retention is not None
    now = env.clock.now() + timedelta(days=31)
    week, day = timedelta(days=30), timedelta(hours=24)
    report = await retention.sweep(now=now, keep=week, windows=day, limit=10)
    assert report.purged == [] and report.kept == 1
    assert (await env.load(sid)).state is SessionState.COMPLETED


def test_retention_shorter_than_the_24_hour_windows_is_refused() -> None:
    with pytest.raises(ConfigError, match="86400"):
        Settings.build({"storage": {"retention_s": 3600}})
    assert Settings.build({}).storage.retention_s == 30 * 24 * 3600
