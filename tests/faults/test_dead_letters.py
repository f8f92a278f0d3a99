"""A compensation the far side never takes becomes a visible dead letter an operator can
resend, instead of a FAILED entry nobody hears of.

The OA system's undo endpoint is down (a World gate, seen by every process): the
compensation of a timed-out session is retried with backoff, gives up after
``MAX_DISPATCH_ATTEMPTS``, and stays in the outbox as DEAD with one ``dead_letter``
alert. Once the far side is back, ``resend_outbox`` sends it under the same key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.wiring import session_runtime
from tests.support.harness import Env, local_env
from torpor import outbox
from torpor.errors import InvalidRequest, OutboxEntryNotSendable
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxEntry, OutboxKind, SessionSnapshot
from torpor.ports import Observer, Reason

UNDO_KEY = "acme:approve:PR-1:1:compensate"


class DeadLetters(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def dead_letter(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        self.seen.append((snapshot.session_id, entry.entry_id))


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(
        tmp_path, redis_url, redis_prefix, sla_s=60, compensate_gate="undo-up"
    ) as e:
        e.services.observer = DeadLetters()
        yield e


def undo_of(snap: SessionSnapshot) -> OutboxEntry:
    [entry] = [e for e in snap.outbox if e.kind is OutboxKind.COMPENSATE]
    return entry


async def exhaust_the_compensation(env: Env) -> tuple[str, OutboxEntry]:
    sid = await env.submit()
    env.clock.advance(61)
    runtime = session_runtime(env.services, "sweeper")
    await runtime.activate(sid, reason=Reason.TIMEOUT)
    for _ in range(outbox.MAX_DISPATCH_ATTEMPTS):
        entry = undo_of(await env.load(sid))
        if entry.status is not DispatchStatus.PENDING:
            break
        assert entry.next_attempt_at is not None
        env.clock.set(entry.next_attempt_at)
        await runtime.activate(sid, reason=Reason.RETRY)
    snap = await env.load(sid)
    assert snap.state is SessionState.TIMED_OUT
    return sid, undo_of(snap)


async def test_a_compensation_that_gives_up_is_a_dead_letter_with_an_alert(env: Env) -> None:
    sid, entry = await exhaust_the_compensation(env)
    assert entry.status is DispatchStatus.DEAD
    assert entry.attempts == outbox.MAX_DISPATCH_ATTEMPTS and entry.last_error
    assert isinstance(env.services.observer, DeadLetters)
    assert env.services.observer.seen == [(sid, entry.entry_id)]
    # A dead letter is not retried by itself, and is not alerted twice.
    env.clock.advance(3600)
    await session_runtime(env.services, "sweeper").activate(sid, reason=Reason.RETRY)
    assert undo_of(await env.load(sid)).status is DispatchStatus.DEAD
    assert env.services.observer.seen == [(sid, entry.entry_id)]
    assert await env.world.counts("compensate") == {}


async def test_an_operator_resends_a_dead_letter_once_the_far_side_is_back(env: Env) -> None:
    sid, entry = await exhaust_the_compensation(env)
    await env.world.open_gate("undo-up")
    revived = await env.control.resend_outbox(sid, entry.entry_id)
    assert revived.status is DispatchStatus.PENDING and revived.attempts == 0
    sent = undo_of(await env.load(sid))
    assert sent.status is DispatchStatus.DISPATCHED, "the activation sent it"
    assert await env.world.counts("compensate") == {UNDO_KEY: 1}
    with pytest.raises(InvalidRequest, match="not a dead letter"):
        await env.control.resend_outbox(sid, entry.entry_id)
    with pytest.raises(InvalidRequest, match="no outbox entry"):
        await env.control.resend_outbox(sid, "nope")
    assert (await env.load(sid)).state is SessionState.TIMED_OUT


async def test_a_dead_letter_whose_agent_is_gone_is_refused_not_left_pending(
    env: Env, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The resend's activation sends an undo through the agent's tool: on a cluster where
    the agent is no longer configured nothing would ever send it, and the entry, PENDING,
    would leave the operator's dead letters without a word."""
    sid, entry = await exhaust_the_compensation(env)
    await env.world.open_gate("undo-up")
    async with local_env(tmp_path, redis_url, redis_prefix, extra={"agents": {}}) as gone:
        gone.clock.set(env.clock.now())
        with pytest.raises(OutboxEntryNotSendable, match="not configured"):
            await gone.control.resend_outbox(sid, entry.entry_id)
    still = undo_of(await env.load(sid))
    assert still.status is DispatchStatus.DEAD, "still a dead letter, on the operator's list"
    # Back where the agent is configured, the same resend sends it.
    await env.control.resend_outbox(sid, entry.entry_id)
    assert undo_of(await env.load(sid)).status is DispatchStatus.DISPATCHED
    assert await env.world.counts("compensate") == {UNDO_KEY: 1}
