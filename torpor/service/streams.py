"""Session transitions as Server-Sent Events: capped per tenant, and cheap while idle.

A stream holds one of the replica's request slots for as long as the client listens, so
each tenant may hold at most ``max_streams_per_tenant`` at once on a replica; one more
is refused with 429 and a Retry-After instead of starving the tenant's neighbours (and
the webhooks that share the replica).

An idle stream must not cost object-store reads: it watches the session's generation in
the index's registry (one small index read per tick; a commit that changes the state
records it) and reads the snapshot only when that generation moved, plus a slow safety
read for what the registry does not show: a commit whose transitions end in the state
they started from, a flushed index, a repair not yet run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import ClassVar

from torpor.errors import SessionNotFound, TorporError
from torpor.lifecycle import HistoryEntry
from torpor.models import SessionSnapshot
from torpor.service.sessions import SessionService

TICK_S = 0.5  # how soon a change shows
SAFETY_READ_S = 10.0  # the snapshot is re-read this often even when nothing seems to move
KEEPALIVE_S = 15.0
PROGRESS_S = 1.0  # how often a waiting session's work progress is looked at
RETRY_AFTER_S = 5.0


class TooManyStreams(TorporError):
    """The tenant already holds its share of this replica's event streams."""

    code: ClassVar[str] = "too_many_streams"
    status, title = 429, "Too many event streams"
    public: ClassVar[bool] = True
    retryable = True


class SessionStreams:
    """Opens event streams, counting them per tenant (on this replica)."""

    def __init__(
        self,
        control: SessionService,
        *,
        max_per_tenant: int,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.control = control
        self.max_per_tenant = max_per_tenant
        self._sleep = sleep  # tests pass one that returns at once: no wall time passes
        self._open: dict[str, int] = {}

    def open(self, session_id: str, tenant: str, after: int) -> AsyncIterator[str]:
        """Take one of ``tenant``'s stream slots (TooManyStreams if none is left) and
        return the stream, which gives the slot back when it ends, fails or is closed."""
        if self._open.get(tenant, 0) >= self.max_per_tenant:
            raise TooManyStreams(
                f"at most {self.max_per_tenant} event streams per tenant at once",
                retry_after=RETRY_AFTER_S,
            )
        self._open[tenant] = self._open.get(tenant, 0) + 1
        return HeldStream(self._events(session_id, tenant, after), lambda: self._release(tenant))

    def streams(self, tenant: str) -> int:
        """How many streams ``tenant`` holds open on this replica."""
        return self._open.get(tenant, 0)

    def _release(self, tenant: str) -> None:
        self._open[tenant] -= 1
        if not self._open[tenant]:
            del self._open[tenant]

    async def _events(self, session_id: str, tenant: str, after: int) -> AsyncGenerator[str, None]:
        """Transitions; ``id`` is the history sequence number, so a client that reconnects
        with ``Last-Event-ID`` gets exactly what it missed."""
        registry = self.control.services.index
        quiet = unread = 0.0
        # The registry's generation is read before the snapshot: a commit in between
        # only costs one more read, never a missed change.
        seen = await registry.session_generation(session_id)
        snapshot = await self._read(session_id, tenant)
        shown: list[str] = []  # the progress reports last sent
        since_progress = PROGRESS_S
        while snapshot is not None:
            for entry in snapshot.history:
                if entry.seq > after:
                    yield _transition(session_id, entry)
                    after, quiet = entry.seq, 0.0
            if snapshot.terminal:
                return
            while True:
                await self._sleep(TICK_S)
                quiet, unread = quiet + TICK_S, unread + TICK_S
                if quiet >= KEEPALIVE_S:
                    quiet = 0.0
                    yield ": keep-alive\n\n"
                since_progress += TICK_S
                if snapshot.waits and since_progress >= PROGRESS_S:
                    # Only while the session waits: its work may be reporting. Progress
                    # lives outside the snapshot, so it shows without waking anything.
                    since_progress = 0.0
                    reports = await self.control.progress(session_id)
                    current = [p.model_dump_json() for p in reports]
                    if current != shown:
                        shown, quiet = current, 0.0
                        for report in current:
                            yield f"event: progress\ndata: {report}\n\n"
                generation = await registry.session_generation(session_id)
                if generation != seen or unread >= SAFETY_READ_S:
                    break
            seen, unread = generation, 0.0
            snapshot = await self._read(session_id, tenant)

    async def _read(self, session_id: str, tenant: str) -> SessionSnapshot | None:
        """The session, or None once it is gone. The route found it before the 200 went
        out, but retention may delete it since (between that look and the first read, or
        while the stream waits): raised, SessionNotFound cut the response mid-stream with
        a traceback in the server's log. The stream ends instead; the client's reconnect
        is answered 404, as a session it never had is."""
        try:
            return await self.control.get(session_id, tenant=tenant)
        except SessionNotFound:
            return None


class HeldStream:
    """A stream that gives its slot back exactly once: at its end, on an error (the
    client went away: the task is cancelled) or on ``aclose``, even if never started."""

    def __init__(self, inner: AsyncGenerator[str, None], release: Callable[[], None]) -> None:
        self._inner, self._release, self._held = inner, release, True

    def __aiter__(self) -> HeldStream:
        return self

    async def __anext__(self) -> str:
        try:
            return await self._inner.__anext__()
        except BaseException:
            self._give_back()
            raise

    async def aclose(self) -> None:
        self._give_back()
        await self._inner.aclose()

    def _give_back(self) -> None:
        if self._held:
            self._held = False
            self._release()


def _transition(session_id: str, entry: HistoryEntry) -> str:
    data = {
        "session_id": session_id,
        "state": entry.state.value,
        "epoch": entry.epoch,
        "at": entry.at.isoformat(),
        "reason": entry.reason,
    }
    return f"id: {entry.seq}\nevent: transition\ndata: {json.dumps(data)}\n\n"
