"""Timers in memory: one due time per (kind, member)."""

from __future__ import annotations

from datetime import datetime

from torpor.clock import to_ms
from torpor.ports import TimerKind


class MemoryTimers:
    def __init__(self) -> None:
        self._timers: dict[TimerKind, dict[str, int]] = {kind: {} for kind in TimerKind}
        super().__init__()

    async def schedule(
        self,
        *,
        kind: TimerKind,
        member: str,
        at: datetime,
        keep_earlier: bool = False,
        if_absent: bool = False,
    ) -> None:
        if keep_earlier and if_absent:
            raise ValueError("keep_earlier and if_absent exclude each other")
        timers, at_ms = self._timers[kind], to_ms(at)
        if if_absent and member in timers:
            return
        if keep_earlier and member in timers:
            at_ms = min(at_ms, timers[member])
        timers[member] = at_ms

    async def unschedule(
        self, *, kind: TimerKind, member: str, if_at: datetime | None = None
    ) -> None:
        timers = self._timers[kind]
        if if_at is None or timers.get(member) == to_ms(if_at):
            timers.pop(member, None)

    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        now_ms = to_ms(now)
        due = sorted((at, m) for m, at in self._timers[kind].items() if at <= now_ms)
        return [m for _, m in due[:limit]]

    async def lease_due(
        self, *, kind: TimerKind, now: datetime, limit: int, until: datetime
    ) -> list[str]:
        members = await self.due(kind=kind, now=now, limit=limit)
        for member in members:
            self._timers[kind][member] = to_ms(until)
        return members
