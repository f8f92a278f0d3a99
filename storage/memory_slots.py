"""Running slots in one process's memory (``memory://`` index): for unit tests.

Every method finishes without yielding to the event loop, so each is atomic for the
coroutines of that loop. Expiry is in the loop's monotonic time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

from torpor.ports import SlotEntry, SlotUsage


@dataclass
class _Member:
    scopes: tuple[str, ...]
    queue: str
    rank: int


class MemorySlots:
    def __init__(self) -> None:
        self._members: dict[str, _Member] = {}
        self._caps: dict[str, int] = {}
        self._slots: dict[str, dict[str, float]] = {}  # scope -> member -> expiry
        self._queues: dict[str, dict[str, int]] = {}  # queue -> member -> rank

    async def register(
        self, *, members: dict[str, int], scopes: dict[str, int], queue: str
    ) -> None:
        self._caps.update(scopes)
        for member, rank in members.items():
            self._members[member] = _Member(tuple(scopes), queue, rank)

    def _live(self, scope: str) -> dict[str, float]:
        now = time.monotonic()
        slots = self._slots.setdefault(scope, {})
        for member in [m for m, exp in slots.items() if exp <= now]:
            del slots[member]
        return slots

    async def enter(self, *, member: str, ttl: timedelta) -> SlotEntry:
        found = self._members.get(member)
        if found is None:
            return SlotEntry.UNCAPPED
        for scope in found.scopes:
            live = self._live(scope)
            if member not in live and len(live) >= self._caps[scope]:
                self._queues.setdefault(found.queue, {})[member] = found.rank
                # And in the full scope's queue: another batch giving a slot of it back
                # wakes this one too (a tenant's cap, ``RedisSlots``).
                self._queues.setdefault(scope, {})[member] = found.rank
                return SlotEntry.WAITING
        until = time.monotonic() + ttl.total_seconds()
        for scope in found.scopes:
            self._slots[scope][member] = until
            self._queues.get(scope, {}).pop(member, None)
        self._queues.get(found.queue, {}).pop(member, None)
        return SlotEntry.ADMITTED

    async def leave(self, *, member: str, forget: bool, limit: int) -> list[str]:
        found = self._members.get(member)
        if found is None:
            return []
        for scope in found.scopes:
            self._slots.get(scope, {}).pop(member, None)
        if forget:
            del self._members[member]
            for name in (found.queue, *found.scopes):
                self._queues.get(name, {}).pop(member, None)
        heads: dict[str, None] = {}
        for name in dict.fromkeys((found.queue, *found.scopes)):
            queue = self._queues.get(name, {})
            heads.update(dict.fromkeys(sorted(queue, key=lambda m: queue[m])[:limit]))
        return list(heads)

    async def usage(self, *, scope: str, queue: str | None = None) -> SlotUsage:
        return SlotUsage(len(self._live(scope)), len(self._queues.get(queue or scope, {})))

    async def close(self) -> None:
        return None
