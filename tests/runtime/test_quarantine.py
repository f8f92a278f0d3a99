"""A snapshot that cannot be decoded is quarantined, visibly, and retried by an operator;
one written by a newer torpor is left for it, retried at the backoff's cap."""

from __future__ import annotations

from storage import keys
from storage.codec import SnapshotCodec
from tests.runtime.memory_env import MemEnv, memory_env, plan_agent, reset
from torpor.lifecycle import SessionState
from torpor.models import SCHEMA_VERSION
from torpor.ports import Reason, TimerKind
from torpor.session import ActivationOutcome

S = SessionState
PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
AGENTS = {"a": plan_agent(PLAN, {"tests.runtime.memory_env:Approve": {}})}


async def corrupt_body(env: MemEnv, sid: str) -> bytes:
    """Spoil the compressed body, keep the header: the snapshot no longer decodes."""
    key = keys.snapshot(sid)
    good = (await env.services.store.get(key)).data
    await env.services.store.put(key, good[:-16] + b"\x00" * 16)
    return good


async def test_a_corrupt_snapshot_is_quarantined_not_retried_for_ever() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        good = await corrupt_body(env, sid)
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.QUARANTINED
        index = env.services.index
        assert (await index.session_states([sid]))[sid] is S.QUARANTINED
        far = env.clock.now() + env.services.config.retry_cap * 10
        assert sid not in await index.due(kind=TimerKind.RETRY, now=far, limit=10)
        # Shown as what it is, with the decode error as the reason.
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is S.QUARANTINED and shown.quarantine is not None
        assert shown.quarantine.code == "snapshot_corrupt"
        assert shown.quarantine.resume_to is S.SUSPENDED
        # Once it reads again (restored, or an upgrade reads it) the operator retries.
        await env.services.store.put(keys.snapshot(sid), good)
        await env.control.retry(sid, tenant="acme")
        assert (await index.session_states([sid]))[sid] is S.SUSPENDED
        assert (await env.control.get(sid)).state is S.SUSPENDED


async def test_a_snapshot_from_a_newer_torpor_is_left_for_it_at_the_backoff_cap() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await env.submit("a")
        newer = (await env.load(sid)).model_copy(update={"schema_version": SCHEMA_VERSION + 1})
        await env.services.store.put(keys.snapshot(sid), SnapshotCodec().encode(newer))
        result = await env.runtime.activate(sid, reason=Reason.EVENT)
        assert result.outcome is ActivationOutcome.STOPPED
        # Not every sweep: at the cap of the one backoff (± its jitter).
        index, cap = env.services.index, env.services.config.retry_cap
        assert sid not in await index.due(
            kind=TimerKind.RETRY, now=env.clock.now() + cap * 0.7, limit=9
        )
        assert sid in await index.due(
            kind=TimerKind.RETRY, now=env.clock.now() + cap * 1.3, limit=9
        )
