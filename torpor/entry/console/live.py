"""The console's live counts: sessions per state (and one session's state) as Server-Sent
Events, sent only when they change, a comment now and then to keep proxies from closing
an idle stream. Each login key holds at most ``max_per_key`` streams on a replica (one
more is refused with 429, as the session event streams are); a stream gives its slot
back when it ends, fails or is closed, even if it never started."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from torpor.entry.console import reads
from torpor.ports.services import Services
from torpor.service.streams import RETRY_AFTER_S, HeldStream, TooManyStreams

KEEPALIVE_S = 15.0


class LiveCounts:
    def __init__(self, services: Services, *, max_per_key: int, tick_s: float) -> None:
        self.services = services
        self.max_per_key = max_per_key
        self.tick_s = tick_s
        self._open: dict[str, int] = {}

    def open(
        self,
        key: str,
        tenants: list[str],
        session_id: str | None,
        *,
        signed_in: Callable[[], Awaitable[bool]],
    ) -> AsyncIterator[str]:
        if self._open.get(key, 0) >= self.max_per_key:
            raise TooManyStreams(
                f"at most {self.max_per_key} live console streams per login key at once",
                retry_after=RETRY_AFTER_S,
            )
        self._open[key] = self._open.get(key, 0) + 1
        events = self._events(tenants, session_id, signed_in)
        return HeldStream(events, lambda: self._release(key))

    def _release(self, key: str) -> None:
        self._open[key] -= 1
        if not self._open[key]:
            del self._open[key]

    async def _events(
        self,
        tenants: list[str],
        session_id: str | None,
        signed_in: Callable[[], Awaitable[bool]],
    ) -> AsyncGenerator[str, None]:
        last: str | None = None
        quiet = 0.0
        # The login is checked at every tick, not only when the stream opened: a stream
        # open in a tab outlived its logout (or its key's removal, or its expiry), and
        # went on showing the tenants' counts to whoever had the tab.
        while await signed_in():
            data: dict[str, Any] = {"counts": await reads.counts(self.services, tenants)}
            if session_id is not None:
                state = (await self.services.index.session_states([session_id])).get(session_id)
                data["session"] = {"id": session_id, "state": state.value if state else None}
            encoded = json.dumps(data, sort_keys=True)
            if encoded != last:
                last, quiet = encoded, 0.0
                yield f"event: counts\ndata: {encoded}\n\n"
            elif quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield ": keep-alive\n\n"
            await asyncio.sleep(self.tick_s)
            quiet += self.tick_s
