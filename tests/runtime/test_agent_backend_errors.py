"""An agent whose backend is out of reach is retried; an agent's bug fails its session.

A custom agent calls its LLM with a client of its own and lets the client's transport
error out (not ``AgentUnavailable``): the session failed for good at the first refused
connection. It is retried with the session core's backoff now, as ``AgentUnavailable``
is, and carries on once the backend answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import ClassVar

import httpx
import pytest
from pydantic import JsonValue

from tests.runtime.memory_env import memory_env, reset
from torpor.agent import AgentContext, AgentTurn, default_initial_messages
from torpor.errors import ResolversBusy, StorageUnavailable, TorporError
from torpor.lifecycle import SessionState
from torpor.models import Message
from torpor.ports import Reason, TimerKind

S = SessionState


class FlakyBackend:
    """Its first steps raise what the test puts in ``FAILURES``; then it finishes."""

    name = "flaky"
    version = "1"
    FAILURES: ClassVar[list[Exception]] = []

    def initial_messages(self, input: JsonValue, ctx: AgentContext) -> list[Message]:
        return default_initial_messages(input, None)

    async def step(self, messages: Sequence[Message], ctx: AgentContext) -> AgentTurn:
        if self.FAILURES:
            raise self.FAILURES.pop(0)
        return AgentTurn(Message(role="assistant", content="done"), result="done")


AGENTS = {"flaky": {"factory": "tests.runtime.test_agent_backend_errors:FlakyBackend"}}


async def test_a_refused_connection_to_the_agents_backend_is_retried_not_fatal() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        FlakyBackend.FAILURES[:] = [httpx.ConnectError("[Errno 111] Connection refused")]
        sid = await env.submit("flaky")
        snap = await env.load(sid)
        assert snap.state is S.RUNNING, (snap.state, snap.error)
        assert snap.retry.used == 1
        later = env.clock.now() + env.services.config.retry_cap
        assert await env.services.index.due(kind=TimerKind.RETRY, now=later, limit=9) == [sid]
        env.clock.advance(env.services.config.retry_cap.total_seconds())
        await env.runtime.activate(sid, reason=Reason.RETRY)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.result == "done"


async def test_a_session_waiting_out_its_backoff_is_not_woken_before_it() -> None:
    """The retry timer brings it back after the backoff. The wake-up its start armed
    stayed until now: it came every ``wake_grace_s`` and spent the retry quota in
    minutes, whatever the backoff said."""
    async with memory_env(AGENTS) as env:
        reset()
        FlakyBackend.FAILURES[:] = [httpx.ConnectError("[Errno 111] Connection refused")]
        sid = await env.submit("flaky")
        assert (await env.load(sid)).retry.used == 1
        far = env.clock.now() + timedelta(days=365)
        index = env.services.index
        assert await index.due(kind=TimerKind.WAKE, now=far, limit=9) == []
        assert await index.due(kind=TimerKind.RETRY, now=far, limit=9) == [sid]


async def test_an_agents_own_bug_still_fails_its_session() -> None:
    async with memory_env(AGENTS) as env:
        reset()
        FlakyBackend.FAILURES[:] = [KeyError("choices")]
        sid = await env.submit("flaky")
        snap = await env.load(sid)
        assert snap.state is S.FAILED
        assert snap.error is not None and snap.error.code == "agent_crashed"


@pytest.mark.parametrize(
    "error",
    [
        ResolversBusy("every resolver thread is busy"),  # an OSError too
        StorageUnavailable("the object store did not answer"),
        TorporError("the agent's backend asks for a pause", retryable=True),
    ],
    ids=type,
)
async def test_a_retryable_torpor_error_from_the_agent_is_retried_not_fatal(
    error: TorporError,
) -> None:
    """Every ``TorporError`` but ``AgentUnavailable`` and ``CallTimedOut`` failed the
    session for good, whatever its ``retryable`` said: a busy resolver of an agent that
    vets its endpoint (``torpor.ssrf``), an OSError, ended the session where a refused
    connection is retried."""
    async with memory_env(AGENTS) as env:
        reset()
        FlakyBackend.FAILURES[:] = [error]
        sid = await env.submit("flaky")
        snap = await env.load(sid)
        assert snap.state is S.RUNNING, (snap.state, snap.error)
        assert snap.retry.used == 1
        env.clock.advance(env.services.config.retry_cap.total_seconds())
        await env.runtime.activate(sid, reason=Reason.RETRY)
        done = await env.load(sid)
        assert done.state is S.COMPLETED and done.result == "done"
