"""Activation requests behind an HTTP answer, coalesced per session.

In an HTTP handler the answer goes out first and the activation request runs behind it.
A burst for one session (duplicates, a batch of its events) costs one more request at
most: the activation that runs next sees every event so far. Past a bound of requests in
flight the request is not sent, and neither is one that failed: instead a retry timer is
made sure of (never delayed if one is due sooner) and counted, so the reconciler
activates the session while this replica keeps answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torpor.ports import Activator, Clock, Observer, Reason, TimerIndex, TimerKind
from torpor.ports.services import Services

log = logging.getLogger(__name__)


async def request_activation(
    activator: Activator, session_id: str, reason: Reason, agent: str | None
) -> bool:
    """Ask for an activation; True if it was taken. A failure is logged, never raised:
    the state is durable already and a timer brings the reconciler round."""
    try:
        await activator.request(session_id, reason=reason, agent=agent)
    except Exception:
        log.warning(
            "activation request for %s failed; the reconciler will retry",
            session_id,
            exc_info=True,
        )
        return False
    return True


@dataclass(frozen=True)
class Fallback:
    """What brings a session round when its activation request is not sent now."""

    timers: TimerIndex
    clock: Clock
    observer: Observer
    delay: timedelta

    @classmethod
    def of(cls, services: Services) -> Fallback:
        return cls(services.index, services.clock, services.observer, services.config.retry_delay)

    async def arm(self, session_id: str, why: str) -> None:
        """Make sure a retry timer is due within ``delay`` (an earlier one stays)."""
        try:
            at = self.clock.now() + self.delay
            await self.timers.schedule(
                kind=TimerKind.RETRY, member=session_id, at=at, keep_earlier=True
            )
        except Exception:  # the index is down too: the full repair finds the session
            log.exception("no retry timer for %s (%s)", session_id, why)
        await self.observer.activation_deferred(why)


class Coalescer:
    """At most one background activation request in flight per session."""

    def __init__(self, activator: Activator, *, max_inflight: int, fallback: Fallback) -> None:
        self.activator = activator
        self.max_inflight = max_inflight
        self.fallback = fallback
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: set[str] = set()
        self._again: set[str] = set()

    def request(self, session_id: str, reason: Reason, agent: str | None) -> None:
        """Start (or mark for one more round) a background request; returns at once."""
        if session_id in self._inflight:
            self._again.add(session_id)
            return
        if len(self._inflight) >= self.max_inflight:
            # Backpressure: not sent, but never dropped silently.
            self._spawn(self.fallback.arm(session_id, "backpressure"))
            return
        self._inflight.add(session_id)
        self._spawn(self._coalesced(session_id, reason, agent))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _coalesced(self, session_id: str, reason: Reason, agent: str | None) -> None:
        try:
            taken = await request_activation(self.activator, session_id, reason, agent)
            while taken and session_id in self._again:
                self._again.discard(session_id)
                taken = await request_activation(self.activator, session_id, Reason.EVENT, agent)
            if not taken:
                self._again.discard(session_id)
                await self.fallback.arm(session_id, "request_failed")
        finally:
            self._inflight.discard(session_id)

    async def drain(self) -> None:
        """Wait for background activation requests (tests, orderly shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
