"""Leases with fencing tokens in memory."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

from storage.memory_index.waits import ms
from torpor.clock import from_ms, to_ms
from torpor.ports import Lease


class MemoryLeases:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}  # released leases are removed
        self._fences: dict[str, int] = {}  # survives release, so tokens only grow
        self._expiry: dict[str, int] = {}  # unreleased leases → expiry ms (for the sweeper)
        super().__init__()

    def _grant(self, name: str, owner: str, token: int, expires_ms: int) -> Lease:
        lease = Lease(name, owner, token, from_ms(expires_ms))
        self._leases[name] = lease
        self._expiry[name] = expires_ms
        return lease

    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None:
        current = self._leases.get(name)
        if current is not None and to_ms(current.expires_at) > to_ms(now):
            return None
        token = self._fences[name] = self._fences.get(name, 0) + 1
        granted = self._grant(name, owner, token, to_ms(now) + ms(ttl))
        # Released leases are removed, so one still here expired in its holder's hands.
        return replace(granted, taken_over=current is not None)

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        # Still ours is enough: a late heartbeat whom nobody replaced may go on.
        current = self._leases.get(lease.name)
        if current is None or (current.owner, current.token) != (lease.owner, lease.token):
            return None
        return self._grant(lease.name, lease.owner, lease.token, to_ms(now) + ms(ttl))

    async def raise_fence(
        self, lease: Lease, *, floor: int, ttl: timedelta, now: datetime
    ) -> Lease | None:
        current = self._leases.get(lease.name)
        if current is None or (current.owner, current.token) != (lease.owner, lease.token):
            return None
        token = self._fences[lease.name] = max(self._fences.get(lease.name, 0), floor) + 1
        return self._grant(lease.name, lease.owner, token, to_ms(now) + ms(ttl))

    async def release_lease(self, lease: Lease) -> bool:
        current = self._leases.get(lease.name)
        if current is None or (current.owner, current.token) != (lease.owner, lease.token):
            return False
        del self._leases[lease.name]
        self._expiry.pop(lease.name, None)
        return True

    async def expired_leases(self, *, now: datetime, limit: int) -> list[str]:
        now_ms = to_ms(now)
        return [n for _, n in sorted((e, n) for n, e in self._expiry.items() if e <= now_ms)][
            :limit
        ]

    async def drop_lease(self, *, name: str) -> None:
        self._leases.pop(name, None)
        self._fences.pop(name, None)
        self._expiry.pop(name, None)

    async def forget_lease(self, *, name: str, now: datetime) -> None:
        if self._expiry.get(name, 0) <= to_ms(now):
            self._expiry.pop(name, None)
