"""Reachability, shutdown and the integrity marker of the in-memory index."""

from __future__ import annotations

import secrets
from datetime import datetime


class MemoryHealth:
    def __init__(self) -> None:
        self._intact = False
        self._repairing: str | None = None
        self._last_sweep: datetime | None = None
        super().__init__()

    @property
    def url(self) -> str:
        return "memory://"

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def begin_repair(self) -> str:
        self._repairing = secrets.token_hex(8)
        return self._repairing

    async def mark_intact(self, token: str) -> bool:
        if self._repairing != token:
            return False
        self._intact, self._repairing = True, None
        return True

    async def is_intact(self) -> bool:
        return self._intact

    async def record_sweep(self, *, at: datetime) -> None:
        self._last_sweep = at

    async def last_sweep(self) -> datetime | None:
        return self._last_sweep
