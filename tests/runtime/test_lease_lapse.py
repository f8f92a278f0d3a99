"""An activation whose lease lapsed (its index out of reach for a whole TTL, so the
reconciler may have recovered the session elsewhere) calls no more tools: the holder that
recovered it runs them from the last checkpoint, and this one would run them twice."""

from __future__ import annotations

import pytest

from tests.runtime import memory_env
from tests.runtime.memory_env import memory_env as open_env
from tests.runtime.memory_env import plan_agent, reset
from torpor.lifecycle import SessionState
from torpor.session.heartbeat import Heartbeat

TWO_CALLS = {
    "steps": [
        {"id": "first", "calls": [{"tool": "hang", "args": {"n": 1}}]},
        {"id": "second", "calls": [{"tool": "hang", "args": {"n": 2}}]},
    ]
}


async def test_no_tool_is_called_once_the_lease_has_lapsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    probe = reset()
    # The index goes out of reach for a whole TTL while the first call runs.
    lapsed = lambda self: len(memory_env.PROBE.calls) >= 1  # noqa: E731
    monkeypatch.setattr(Heartbeat, "lapsed", lapsed, raising=False)
    agents = {"p": plan_agent(TWO_CALLS, {"tests.runtime.memory_env:HangingTool": {}})}
    async with open_env(agents) as env:
        sid = await env.submit("p")
        assert [tool for tool, _ in probe.calls] == ["hang"]  # the second was never called
        assert (await env.load(sid)).state is not SessionState.COMPLETED
