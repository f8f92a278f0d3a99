"""The gateway's values (``torpor.service.gateway``): what one event did, as its
sender is told (``Outcome``), what routing it left (``Routed``), the answer
(``HookResult``), and what the steps between hand each other (``_Seen``, ``_Resolved``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from torpor.ports import WaitBinding


class Outcome(StrEnum):
    """What one event did, as the sender is told."""

    ACCEPTED = "accepted"  # 202: stored, the session will apply it
    DUPLICATE = "duplicate"  # 200: stored before
    STALE = "stale"  # 200: names an older request (epoch) than the one open: observed only
    LATE = "late"  # 200: after the wait's deadline: observed, the session times out
    CLOSED = "closed"  # 200: the wait it answers is closed already: observed only
    AMBIGUOUS = "ambiguous"  # 409: could answer a re-planned request: recorded, not applied
    UNEXPECTED = "unexpected"  # 403: the wait does not name this source: recorded, not applied
    UNKNOWN = "unknown"  # 404: no wait of this tenant matches

    @property
    def status(self) -> int:
        return {
            Outcome.ACCEPTED: 202,
            Outcome.AMBIGUOUS: 409,
            Outcome.UNEXPECTED: 403,
            Outcome.UNKNOWN: 404,
        }.get(self, 200)


@dataclass(frozen=True)
class Routed:
    event_id: str
    session_id: str | None
    outcome: Outcome
    duplicate: bool = False
    replayed: bool = False  # a duplicate whose exact request was accepted before
    # The session to activate once the request is remembered (its wake timer is armed):
    # asked for last, so the session's own work does not compete with the answer's.
    activate: tuple[str, str | None] | None = None
    # The audit record of a stored event, still being written (beside the replay marker).
    audit: asyncio.Future[Any] | None = None
    # Awaited before the answer: the stored event on disk (``InboxRepository.stage``).
    durable: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class HookResult:
    status: int
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Seen:
    outcome: Outcome
    trace_id: str | None = None
    agent: str | None = None


@dataclass(frozen=True)
class _Resolved:
    binding: WaitBinding | None
    from_record: bool  # the index missed: the wait may be closed (or the index flushed)
