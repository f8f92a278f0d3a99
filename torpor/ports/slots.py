"""The running-slots port: caps on how many sessions of a batch (and of a tenant's
batches) RUNNING at once, the rest waiting durably in document order.

A slot is a lease: it expires on its own after ``ttl`` (longer than an activation may
last), so a holder that dies without leaving gives its slot back by itself, and its
recovery (the reconciler re-activates a session whose lease expired) re-enters the very
slot it held. Members are registered with their scopes once, when the batch creates
them; a member that was never registered is not capped.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Protocol


class SlotEntry(StrEnum):
    ADMITTED = "admitted"  # holds a slot in every scope now (or already did)
    WAITING = "waiting"  # some scope is full: queued, comes next when a slot frees
    UNCAPPED = "uncapped"  # not registered: no cap applies


@dataclass(frozen=True, slots=True)
class SlotUsage:
    running: int  # live slots
    waiting: int  # members queued for one


class RunningSlots(Protocol):
    async def register(
        self, *, members: dict[str, int], scopes: dict[str, int], queue: str
    ) -> None:
        """Register ``members`` (member -> rank in ``queue``) under ``scopes`` (scope ->
        cap). Idempotent."""
        ...

    async def enter(self, *, member: str, ttl: timedelta) -> SlotEntry:
        """Take (or renew) a slot in each of the member's scopes, all or none; queue it
        if one is full."""
        ...

    async def leave(self, *, member: str, forget: bool, limit: int) -> list[str]:
        """Give the member's slots back (``forget``: and its registration, it has ended);
        the first ``limit`` queued members of its queue and of each of its scopes' (those
        of other batches waiting for its tenant's cap), to be tried next."""
        ...

    async def usage(self, *, scope: str, queue: str | None = None) -> SlotUsage: ...

    async def close(self) -> None: ...


def batch_scope(batch_id: str) -> str:
    return f"batch:{batch_id}"


def tenant_scope(tenant: str) -> str:
    return f"tenant:{tenant}"
