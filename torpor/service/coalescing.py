"""Activation requests behind an HTTP answer, coalesced per session.

In an HTTP handler the answer goes out first and the activation request runs behind it.
A burst for one session (duplicates, a batch of its events) costs one more request at
most: the activation that runs next sees every event so far. Past a bound of requests in
flight the request is dropped: the event is durable and its activation timer is set, so
the reconciler activates the session and this replica keeps answering meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

from torpor.ports import Activator, Reason

log = logging.getLogger(__name__)


async def request_activation(
    activator: Activator, session_id: str, reason: Reason, agent: str | None
) -> None:
    """Ask for an activation; a failure is logged, never raised: the state is durable
    already and the activation timer brings the reconciler round."""
    try:
        await activator.request(session_id, reason=reason, agent=agent)
    except Exception:
        log.warning(
            "activation request for %s failed; the reconciler will retry",
            session_id,
            exc_info=True,
        )


class Coalescer:
    """At most one background activation request in flight per session."""

    def __init__(self, activator: Activator, *, max_inflight: int) -> None:
        self.activator = activator
        self.max_inflight = max_inflight
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: set[str] = set()
        self._again: set[str] = set()

    def request(self, session_id: str, reason: Reason, agent: str | None) -> None:
        """Start (or mark for one more round) a background request; returns at once."""
        if session_id in self._inflight:
            self._again.add(session_id)
            return
        if len(self._inflight) >= self.max_inflight:
            return  # backpressure: the reconciler's sweep activates it
        self._inflight.add(session_id)
        task = asyncio.create_task(self._coalesced(session_id, reason, agent))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _coalesced(self, session_id: str, reason: Reason, agent: str | None) -> None:
        try:
            await request_activation(self.activator, session_id, reason, agent)
            while session_id in self._again:
                self._again.discard(session_id)
                await request_activation(self.activator, session_id, Reason.EVENT, agent)
        finally:
            self._inflight.discard(session_id)

    async def drain(self) -> None:
        """Wait for background activation requests (tests, orderly shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
