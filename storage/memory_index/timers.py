"""Timers in memory: one due time per (kind, member)."""

from __future__ import annotations

from datetime import datetime

from torpor.clock import to_ms
from torpor.ports import TimerKind


class MemoryTimers:
    def __init__(self) -> None:
        self._timers: dict[TimerKind, dict[str, int]] = {kind: {} for kind in TimerKind}
        super().__init__()

    async def schedule(self, *, kind: TimerKind, member: str, at: datetime) -> None:
        self._timers[kind][member] = to_ms(at)

    async def unschedule(self, *, kind: TimerKind, member: str) -> None:
        self._timers[kind].pop(member, None)

    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]:
        now_ms = to_ms(now)
        due = sorted((at, m) for m, at in self._timers[kind].items() if at <= now_ms)
        return [m for _, m in due[:limit]]
