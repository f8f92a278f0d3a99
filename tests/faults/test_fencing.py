"""Fencing across index loss: the snapshot's fence, not Redis's counter, is the floor.

The index is flushed between two holders of one session. A holder whose token restarted
below the fence recorded in the snapshot is refused at commit, and the runtime's next
holder is re-fenced above the recorded fence, so tokens keep growing across the flush.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from actors.wiring import session_runtime
from tests.faults.index_loss import flush_index
from tests.support.harness import Env, callback, local_env
from torpor.errors import LeaseLost
from torpor.lifecycle import SessionState
from torpor.ports import Reason
from torpor.session.heartbeat import Heartbeat
from torpor.session.runtime import lease_name
from torpor.session.working import WorkingCopy

TTL = timedelta(seconds=30)


@pytest.fixture
async def env(tmp_path: Path, redis_url: str, redis_prefix: str) -> AsyncIterator[Env]:
    async with local_env(tmp_path, redis_url, redis_prefix) as e:
        yield e


async def fenced_session(env: Env) -> tuple[str, int]:
    """A suspended session whose snapshot records a fence well above 1."""
    sid = await env.submit()
    index = env.services.index
    for _ in range(3):  # other holders came and went: the counter moved on
        lease = await index.acquire_lease(
            name=lease_name(sid), owner="other", ttl=TTL, now=env.clock.now()
        )
        assert lease is not None and await index.release_lease(lease)
    await env.services.inbox.deliver(
        callback(
            sid,
            (await env.load(sid)).waits[0],
            event_id="comment",
            data={"note": "still thinking"},
            at=env.clock.now(),
            type="oa.comment.added",
        )
    )
    await session_runtime(env.services, "before-flush").activate(sid, reason=Reason.EVENT)
    snap = await env.load(sid)
    assert snap.state is SessionState.SUSPENDED and snap.lease_fence > 3
    return sid, snap.lease_fence


async def test_a_holder_whose_token_restarted_after_a_flush_cannot_commit(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    sid, fence = await fenced_session(env)
    await flush_index(redis_url, redis_prefix)
    index = env.services.index
    stale = await index.acquire_lease(
        name=lease_name(sid), owner="stale", ttl=TTL, now=env.clock.now()
    )
    assert stale is not None and stale.token < fence, "the flushed counter restarted"
    snap = await env.load(sid)
    heartbeat = Heartbeat(index, stale, clock=env.clock, period=TTL, ttl=TTL)  # not started
    work = WorkingCopy(env.services, snap, heartbeat)
    work.update(metadata={"written_by": "stale"})
    with pytest.raises(LeaseLost, match="fenced out"):
        await work.commit()
    after = await env.load(sid)
    assert after.generation == snap.generation and "written_by" not in after.metadata


async def test_the_runtime_reseeds_the_fence_from_the_snapshot_after_a_flush(
    env: Env, redis_url: str, redis_prefix: str
) -> None:
    sid, fence = await fenced_session(env)
    await flush_index(redis_url, redis_prefix)
    snap = await env.load(sid)
    await env.services.inbox.deliver(
        callback(sid, snap.waits[0], event_id="ok", data={"status": "approved"}, at=env.clock.now())
    )
    result = await session_runtime(env.services, "after-flush").activate(sid, reason=Reason.EVENT)
    assert result.state is SessionState.COMPLETED
    done = await env.load(sid)
    assert done.lease_fence > fence, "the new holder's token is above every committed one"
    # ...and the counter was raised with it: a later bare holder is above it too.
    later = await env.services.index.acquire_lease(
        name=lease_name(sid), owner="later", ttl=TTL, now=env.clock.now()
    )
    assert later is not None and later.token > done.lease_fence
