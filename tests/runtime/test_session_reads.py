"""Reads of a long session that need none of its sealed history do not fetch it: a
session's history chunks (``storage/chunks.py``) are read only by what uses them."""

from __future__ import annotations

from storage import keys
from tests.runtime.memory_env import MemEnv, memory_env, plan_agent, reset
from tests.storage.test_history_chunks import age
from tests.support.harness import keys_read
from torpor.lifecycle import SessionState

PLAN = {
    "steps": [
        {"id": "approve", "calls": [{"tool": "approve", "args": {"doc": "D-1"}}]},
        {"id": "done", "finish": "${results.approve}"},
    ]
}
AGENTS = {"a": plan_agent(PLAN, {"tests.runtime.memory_env:Approve": {}})}


async def long_waiting_session(env: MemEnv) -> str:
    """A session suspended on its approval after a thousand steps of history."""
    sid = await env.submit("a")
    snap = await env.load(sid)
    assert snap.state is SessionState.SUSPENDED
    aged = await age(env.services.snapshots, snap, 1000)
    assert aged.chunks.messages and aged.chunks.tool_log and aged.chunks.processed_events
    return sid


async def test_showing_a_long_session_reads_none_of_its_history_chunks() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        sid = await long_waiting_session(env)
        read = keys_read(env.services.store)
        shown = await env.control.get(sid, tenant="acme")
        assert shown.state is SessionState.SUSPENDED and len(shown.waits) == 1
        assert not [k for k in read if k.startswith(keys.chunk_prefix(sid))]
