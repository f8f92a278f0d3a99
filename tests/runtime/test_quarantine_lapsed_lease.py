"""An activation whose lease lapsed while it read an undecodable snapshot records no
quarantine: since then the operator may have restored the snapshot and taken the session
back, and a holder after it recorded a newer state, which the quarantine would hide."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from storage import keys
from tests.runtime.memory_env import memory_env, reset
from tests.runtime.test_quarantine import AGENTS, corrupt_body
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.session import ActivationOutcome
from torpor.session.heartbeat import Heartbeat
from torpor.session.runtime import lease_name

S = SessionState


async def test_a_holder_whose_lease_lapsed_mid_read_does_not_quarantine_a_newer_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        good = await corrupt_body(env, sid)
        await env.runtime.activate(sid, reason=Reason.EVENT)  # set aside: QUARANTINED
        index, store, key = env.services.index, env.services.store, keys.snapshot(sid)
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED

        # The slow holder: its read of the (still spoiled) bytes returns only when the
        # test says, and its process is stalled meanwhile (no renewal is sent).
        reading, go = asyncio.Event(), asyncio.Event()
        get = store.get

        async def slow_get(wanted: str, *args: Any, **kwargs: Any) -> Any:
            obj = await get(wanted, *args, **kwargs)
            if wanted == key and not reading.is_set():
                reading.set()
                await go.wait()
            return obj

        async def stalled(self: Heartbeat) -> None:
            return None

        monkeypatch.setattr(store, "get", slow_get)
        monkeypatch.setattr(Heartbeat, "_run", stalled)
        slow = asyncio.create_task(env.runtime.activate(sid, reason=Reason.EVENT))
        await reading.wait()
        monkeypatch.undo()
        ttl = env.services.config.lease_ttl
        assert (
            await index.acquire_lease(
                name=lease_name(sid), owner="probe", ttl=ttl, now=env.clock.now()
            )
            is None
        ), "the slow holder took the lease"

        # Its lease lapses. The operator restores the snapshot and retries; a cancel is
        # committed by the holder after it, and recorded.
        env.clock.advance(ttl.total_seconds() + 1)
        await store.put(key, good)
        await env.control.retry(sid, tenant="acme")
        await env.control.cancel(sid, tenant="acme")
        cancelled = await env.load(sid)
        assert cancelled.state is S.CANCELLED
        assert (await index.session_states([sid]))[sid] is S.CANCELLED

        go.set()  # the slow holder finds the bytes it read undecodable
        result = await slow
        assert (await index.session_states([sid]))[sid] is S.CANCELLED
        assert result.outcome is ActivationOutcome.LEASE_LOST
        assert await index.session_generation(sid) == cancelled.generation
        assert (await env.control.get(sid, tenant="acme")).state is S.CANCELLED
