"""A cancel accepted while the outbox still owes a request: nothing owed goes out after it.

An activation sent what the outbox owed (a request retried after a failure, one a crash
left unsent) before it looked at the inbox, so a cancel accepted meanwhile let the request
reach the far side first, and an undo followed it. Now the cancel comes first: the owed
request is withdrawn (never sent), and undone all the same, since it may have arrived
(a timeout, or a crash between its send and the commit of its status).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.harness import Env, local_env
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxKind

GATE = "oa-up"


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix, dispatch_gate=GATE) as e:
        yield e


async def test_a_request_due_again_when_the_cancel_comes_is_undone_not_sent(env: Env) -> None:
    sid = await env.submit(doc="PR-C")  # the OA system is down: the request fails once
    snap = await env.load(sid)
    [start] = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert start.status is DispatchStatus.PENDING and start.attempts == 1
    assert await env.world.counts("dispatch_refused") == {"acme:approve:PR-C:1": 1}
    await env.world.open_gate(GATE)  # back up, and the retry is due...
    env.clock.advance(60)
    await env.control.cancel(sid)  # ...when the client cancels
    snap = await env.load(sid)
    assert snap.state is SessionState.CANCELLED
    assert await env.world.counts("dispatch") == {}, "the request went out after the cancel"
    # Tried once, it may have reached the OA system before it failed: undone.
    assert await env.world.counts("compensate") == {"acme:approve:PR-C:1:compensate": 1}
    [start] = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert start.status is DispatchStatus.FAILED and "not sent" in (start.last_error or "")


async def test_a_request_a_crash_left_unmarked_is_withdrawn_and_undone(env: Env) -> None:
    await env.world.open_gate(GATE)
    sid = await env.submit(doc="PR-N")
    snap = await env.load(sid)
    assert await env.world.counts("dispatch") == {"acme:approve:PR-N:1": 1}
    # What a process that died after the send, before the commit of its status, leaves:
    # the request pending, never marked tried (the OA system has it).
    unsent = [
        e.model_copy(
            update={"status": DispatchStatus.PENDING, "attempts": 0, "dispatched_at": None}
        )
        if e.kind is OutboxKind.START
        else e
        for e in snap.outbox
    ]
    await env.services.snapshots.save(
        snap.model_copy(update={"outbox": unsent}), expected_generation=snap.generation
    )
    await env.world.close_gate(GATE)  # whatever is sent now would be counted as refused
    await env.control.cancel(sid)
    snap = await env.load(sid)
    assert snap.state is SessionState.CANCELLED
    assert await env.world.counts("dispatch_refused") == {}, "the request was sent after the cancel"
    assert await env.world.counts("compensate") == {"acme:approve:PR-N:1:compensate": 1}
    [start] = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert start.status is DispatchStatus.FAILED and "not sent" in (start.last_error or "")


async def test_a_cancel_with_nothing_owed_still_undoes_the_sent_request(env: Env) -> None:
    await env.world.open_gate(GATE)
    sid = await env.submit(doc="PR-S")
    await env.control.cancel(sid)
    snap = await env.load(sid)
    assert snap.state is SessionState.CANCELLED
    assert await env.world.counts("dispatch") == {"acme:approve:PR-S:1": 1}
    assert await env.world.counts("compensate") == {"acme:approve:PR-S:1:compensate": 1}
    [start] = [e for e in snap.outbox if e.kind is OutboxKind.START]
    assert start.status is DispatchStatus.DISPATCHED
