"""A poison snapshot whose header does not decode either, while the index holds the
session at a newer generation (a live session whose latest snapshot got spoiled): the
quarantine is recorded over it, under the session's tenant, and the operator sees and
retries it."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import keys
from storage.codec import SnapshotCodec
from tests.support.harness import Env, local_env
from torpor.api import SessionOut
from torpor.errors import SessionNotFound
from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot
from torpor.ports import Reason
from torpor.service.sweeper import Sweeper

S = SessionState
pytestmark = pytest.mark.redis


async def spoiled(env: Env) -> tuple[SessionSnapshot, bytes, int]:
    """A suspended session, recorded in the index past generation 0 (the generation is
    returned: the last commits, which change no state, are not recorded), whose snapshot
    is then overwritten with bytes of which nothing reads, not even the header."""
    sid = await env.submit(doc="PR-U")
    snapshot = await env.load(sid)
    indexed = await env.services.index.session_generation(sid)
    assert snapshot.state is S.SUSPENDED and indexed
    store, key = env.services.store, keys.snapshot(sid)
    good = (await store.get(key)).data
    await store.put(key, b"\x00" * 64)
    return snapshot, good, indexed


async def test_an_unread_header_is_quarantined_over_the_indexs_newer_state(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The poison record went in at generation 0 under tenant "", and "newest generation
    wins" refused it: the index kept SUSPENDED for a session nothing can read."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        before, _, indexed = await spoiled(env)
        sid, index = before.session_id, env.services.index
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        assert await index.session_generation(sid) == indexed
        aside = await index.list_sessions(tenant="acme", state=S.QUARANTINED, cursor=None, limit=5)
        assert aside.session_ids == [sid], "listed under its own tenant"
        for state in (None, S.SUSPENDED):
            page = await index.list_sessions(tenant="acme", state=state, cursor=None, limit=5)
            assert page.session_ids == ([sid] if state is None else [])
        for state in (None, S.QUARANTINED):
            ghost = await index.list_sessions(tenant="", state=state, cursor=None, limit=5)
            assert ghost.session_ids == [], 'not under tenant ""'


async def test_a_spoiled_backup_older_than_the_index_is_quarantined_at_the_indexs_generation(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The header reads but names a generation older than the index holds (an operator
    restored a backup that is spoiled too): "newest wins" refused the poison record as it
    refused generation 0, and the index kept the newer live state."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        sid = await env.submit(doc="PR-B")
        snapshot, index = await env.load(sid), env.services.index
        indexed = await index.session_generation(sid)
        assert indexed is not None and indexed >= 2
        older = SnapshotCodec().encode(snapshot.model_copy(update={"generation": 1}))
        await env.services.store.put(keys.snapshot(sid), older[:-16] + b"\x00" * 16)
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        assert await index.session_generation(sid) == indexed
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is S.QUARANTINED and shown.generation == 1


async def test_an_unread_headers_due_deadline_asks_for_no_activation(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """With the index still saying SUSPENDED, the deadline loop asked the session to time
    out at every look: an activation each, failing on the snapshot again, four times a
    second until the deadline's grace ran out. Set aside in the index, its due wait is
    unbound instead and nothing asks."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        before, _, _ = await spoiled(env)
        await env.control.activate(before.session_id, reason=Reason.EVENT)
        [wait] = before.waits
        env.clock.advance((wait.deadline - env.clock.now()).total_seconds() + 1)
        sweeper = Sweeper(env.control)
        assert [await sweeper.deadlines_once() for _ in range(3)] == [0, 0, 0]


async def test_the_operator_sees_an_unread_header_quarantined_and_retries_it(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """Fetching the session raised the decode error (a 500 on GET /v1/sessions/{id}, a
    traceback in the CLI) and the retry, which fetches it first, raised it too. Shown as
    QUARANTINED from what the index holds, with the decode error as the reason; once the
    operator restores the snapshot, the retry takes it back to its state."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        before, good, indexed = await spoiled(env)
        sid, index = before.session_id, env.services.index
        await env.control.activate(sid, reason=Reason.EVENT)
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is S.QUARANTINED and shown.tenant == "acme"
        assert shown.generation == indexed
        assert shown.quarantine is not None and shown.quarantine.code == "snapshot_corrupt"
        assert "magic" in shown.quarantine.reason  # the decode error, as every read finds it
        body = SessionOut.of(shown).model_dump(mode="json")  # GET /v1/sessions/{id}'s answer
        assert body["state"] == "QUARANTINED" and body["quarantine"]["code"] == "snapshot_corrupt"
        with pytest.raises(SessionNotFound):  # another tenant's, as any other
            await env.control.get(sid, tenant="other")
        await env.control.retry(sid, tenant="acme")  # still unreadable: set aside again
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        await env.services.store.put(keys.snapshot(sid), good)  # restored by the operator
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        assert await index.session_generation(sid) == before.generation
        page = await index.list_sessions(tenant="acme", state=S.SUSPENDED, cursor=None, limit=5)
        assert page.session_ids == [sid]
        assert (await env.control.get(sid, tenant="acme")).state is S.SUSPENDED


async def test_a_restored_unread_header_is_lifted_by_the_activation_its_wake_up_asks_for(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The quarantine carries the index's generation, no newer than the snapshot restored
    from before the spoiling: the activation that finds it reads, with nothing to commit,
    lifts it (no newer) with no operator's retry and no repair."""
    async with local_env(tmp_path, redis_url, redis_prefix) as env:
        before, good, _ = await spoiled(env)
        sid, index = before.session_id, env.services.index
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        await env.services.store.put(keys.snapshot(sid), good)
        await env.control.activate(sid, reason=Reason.EVENT)
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        assert await index.session_generation(sid) == before.generation
