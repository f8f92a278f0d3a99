"""Activation in this very process: for tests, tools and single-process use.

The Ray placements (a dedicated actor per session, or a pool of hosts) run exactly the
same ``SessionRuntime``; this activator just skips the actor.
"""

from __future__ import annotations

import asyncio
import logging

from torpor.ports import Reason
from torpor.session import SessionRuntime

log = logging.getLogger(__name__)


class InlineActivator:
    def __init__(self, runtime: SessionRuntime, *, background: bool = False) -> None:
        self.runtime = runtime
        self.background = background
        self._tasks: set[asyncio.Task[object]] = set()

    async def request(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        if not self.background:
            await self.runtime.activate(session_id, reason=reason)
            return
        task = asyncio.create_task(self.runtime.activate(session_id, reason=reason))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("activation failed", exc_info=task.exception())

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
