"""Reachability, shutdown and the integrity marker of the in-memory index."""

from __future__ import annotations

from datetime import datetime


class MemoryHealth:
    def __init__(self) -> None:
        self._intact = False
        self._last_sweep: datetime | None = None
        super().__init__()

    @property
    def url(self) -> str:
        return "memory://"

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def mark_intact(self) -> None:
        self._intact = True

    async def is_intact(self) -> bool:
        return self._intact

    async def record_sweep(self, *, at: datetime) -> None:
        self._last_sweep = at

    async def last_sweep(self) -> datetime | None:
        return self._last_sweep
