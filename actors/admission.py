"""How many dedicated session actors an activator has alive, against its cap
(``max_live_session_actors``): the check ``RayActivator`` makes before it starts one.

Dedicated actors cost a process each (``num_cpus=0`` puts no bound on them); a request
past the cap is deferred by the activator, never dropped."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


class Admission:
    """How many dedicated session actors this activator has alive, against a cap.

    Actors exit on their own when their session sleeps, so once the cap is reached the
    count is checked against Ray (``alive``: the session ids with a live actor, one call
    off the loop), at most every ``refresh_s`` seconds."""

    def __init__(
        self,
        cap: int,
        *,
        alive: Callable[[], Awaitable[set[str]]],
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap = cap
        self._alive = alive
        self._refresh_s = refresh_s
        self._clock = clock
        self._live: set[str] = set()
        self._checked_at = float("-inf")
        self._checking = False

    @property
    def live(self) -> int:
        return len(self._live)

    async def admit(self, session_id: str) -> bool:
        """May ``session_id`` have an actor now? One that is live already always may. A
        check that Ray does not answer in time raises ``ClusterUnavailable``."""
        if session_id in self._live:
            return True
        if (
            len(self._live) >= self.cap
            and not self._checking
            and self._clock() - self._checked_at >= self._refresh_s
        ):
            self._checked_at = self._clock()
            # Requests meanwhile count against the set as it was: deferred at the cap (a
            # RETRY timer), never admitted past it; nothing joins it until this answer.
            # One check at a time: a GCS slower than ``refresh_s`` otherwise had each
            # later request start another, each holding a lookup thread (``named``)
            # that the pool hosts' and session actors' makes then waited for.
            self._checking = True
            try:
                alive = await self._alive()
            finally:
                self._checking = False
            self._live &= alive
        if len(self._live) >= self.cap:
            return False
        self._live.add(session_id)
        return True
