"""Two open waits on one business key in one tenant: the second is refused, never the
silent winner (a business-key-only webhook would otherwise wake the wrong session)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storage import keys
from tests.faults.index_loss import flush_index
from tests.storage.test_history_chunks import age
from tests.support.harness import Env, keys_read, local_env
from torpor.ids import new_session_id
from torpor.lifecycle import SessionState
from torpor.service.sweeper import Sweeper
from torpor.session.suspend import Suspender


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as e:
        yield e


async def test_a_business_key_held_by_another_session_fails_the_call(env: Env) -> None:
    first = await env.submit(doc="PR-1")
    holder = (await env.load(first)).waits[0]
    second = await env.submit(doc="PR-1")
    snap = await env.load(second)
    # The call failed with a typed tool error; the session never suspended on it.
    assert SessionState.SUSPENDED not in [h.state for h in snap.history]
    answer = json.loads(
        next(m.content for m in snap.messages if m.role == "tool" and "error" in (m.content or ""))
    )
    assert answer["error"]["code"] == "business_key_in_use"
    assert snap.state is SessionState.COMPLETED and snap.result == {
        "decision": "error",
        "doc": "PR-1",
    }
    by_key = await env.services.index.resolve(
        tenant="acme", now=env.clock.now(), business_key="PR-1"
    )
    assert by_key is not None and by_key.correlation_id == holder.correlation_id
    assert await env.world.counts("dispatch") == {"acme:approve:PR-1:1": 1}


async def test_the_same_key_in_another_tenant_is_free(env: Env) -> None:
    await env.submit(doc="PR-1")
    other = await env.control.submit(
        tenant="globex", agent="purchase", input={"doc": "PR-1", "amount": 1.0}
    )
    assert (await env.load(other.session_id)).state is SessionState.SUSPENDED


async def test_a_pointer_left_by_a_closed_wait_does_not_refuse(env: Env) -> None:
    first = await env.submit(doc="PR-1")
    assert await env.answer(first, {"status": "approved"})
    assert (await env.load(first)).state is SessionState.COMPLETED
    # As if the first session died between the commit that closed its wait and the unbind.
    await env.services.index.bind_wait(
        (await env.services.correlations.lookup_business_key(tenant="acme", business_key="PR-1"))
        or pytest.fail("no durable pointer"),
        business_key="PR-1",
        grace=env.services.config.binding_grace,
        now=env.clock.now(),
    )
    second = await env.submit(doc="PR-1")
    assert (await env.load(second)).state is SessionState.SUSPENDED


async def test_the_loser_of_a_bind_race_routes_by_correlation_id_only(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await env.submit(doc="PR-1")
    holder = (await env.load(first)).waits[0]

    async def missed(self: Suspender, business_key: str | None) -> str | None:
        return None  # the check ran before the other session bound the key

    monkeypatch.setattr(Suspender, "key_holder", missed)
    second = await env.submit(doc="PR-1")
    loser = (await env.load(second)).waits[0]
    now = env.clock.now()
    index, records = env.services.index, env.services.correlations
    by_key = await index.resolve(tenant="acme", now=now, business_key="PR-1")
    assert by_key is not None and by_key.correlation_id == holder.correlation_id
    durable = await records.lookup_business_key(tenant="acme", business_key="PR-1")
    assert durable is not None and durable.correlation_id == holder.correlation_id
    by_cid = await index.resolve(tenant="acme", now=now, correlation_id=loser.correlation_id)
    assert by_cid is not None and by_cid.session_id == second
    assert await env.answer(second, {"status": "approved"})
    assert (await env.load(second)).state is SessionState.COMPLETED
    assert (await env.load(first)).state is SessionState.SUSPENDED


async def test_repair_leaves_a_contested_key_with_the_wait_that_bound_it_first(
    env: Env, monkeypatch: pytest.MonkeyPatch, redis_url: str, redis_prefix: str
) -> None:
    """The bind race's loser holds no key; after an index loss repair walked sessions by
    id and handed the key to whichever came first, the loser if its id sorted first,
    moving the durable pointer with it: a business-key answer then woke the wrong one."""
    first = await env.submit(doc="PR-1")
    holder = (await env.load(first)).waits[0]

    async def missed(self: Suspender, business_key: str | None) -> str | None:
        return None  # the check ran before the other session bound the key

    monkeypatch.setattr(Suspender, "key_holder", missed)
    earlier_ms = int(env.clock.now().timestamp() * 1000) - 5
    second = (
        await env.control.submit(
            tenant="acme",
            agent="purchase",
            input={"doc": "PR-1", "amount": 100.0},
            session_id=new_session_id(earlier_ms),  # sorts before the first
        )
    ).session_id
    monkeypatch.undo()
    assert second < first and (await env.load(second)).state is SessionState.SUSPENDED
    await flush_index(redis_url, redis_prefix)
    report = await Sweeper(env.control).sweep_once()  # the repair
    assert report.repaired_waits == 2 and report.errors == []
    index, records = env.services.index, env.services.correlations
    by_key = await index.resolve(tenant="acme", now=env.clock.now(), business_key="PR-1")
    assert by_key is not None and by_key.correlation_id == holder.correlation_id
    durable = await records.lookup_business_key(tenant="acme", business_key="PR-1")
    assert durable is not None and durable.correlation_id == holder.correlation_id
    # Once the holder's wait is over, the key is free again, and a repair takes it along.
    assert await env.answer(first, {"status": "approved"})
    await flush_index(redis_url, redis_prefix)
    await Sweeper(env.control).sweep_once()
    by_key = await index.resolve(tenant="acme", now=env.clock.now(), business_key="PR-1")
    assert by_key is not None and by_key.session_id == second


async def test_the_holder_of_a_key_is_judged_without_reading_its_history(env: Env) -> None:
    """The holder's open wait decides, read with one request: its sealed history is not
    fetched (a holder a thousand steps old cost the refused session 58 more reads)."""
    first = await env.submit(doc="PR-1")
    aged = await age(env.services.snapshots, await env.load(first), 1000)
    assert aged.chunks.messages and aged.waits
    read = keys_read(env.services.store)
    second = await env.submit(doc="PR-1")
    assert (await env.load(second)).state is SessionState.COMPLETED  # refused, as above
    assert keys.snapshot(first) in read
    assert not [k for k in read if k.startswith(keys.chunk_prefix(first))]
