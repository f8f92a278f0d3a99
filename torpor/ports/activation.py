"""The activator port: gets a session activated somewhere (in this process, or on a Ray
actor), and the reasons a session is activated."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Reason(StrEnum):
    SUBMIT = "submit"
    EVENT = "event"
    TIMEOUT = "timeout"
    RECOVER = "recover"
    RETRY = "retry"
    CANCEL = "cancel"
    REPAIR = "repair"


class Activator(Protocol):
    """Gets a session activated somewhere (in this process, or on a Ray actor)."""

    async def request(
        self, session_id: str, *, reason: Reason, agent: str | None = None
    ) -> None: ...


@dataclass(frozen=True)
class Wanted:
    """One activation request on its way to a pool host."""

    session_id: str
    reason: Reason
    requested_at: float  # wall clock (epoch seconds) of the request
    traceparent: str | None = None


class ActivationQueue(Protocol):
    """Activation requests to long-lived hosts, one channel per host, through the index's
    server: a push is one round trip, and a host blocked on its channel wakes at once (a
    Ray actor call costs milliseconds more and a process on each side). Best effort by
    design: a request lost with its host is recovered by the session's wake timer, armed
    before any request is sent."""

    async def push(self, channel: str, wanted: Wanted) -> int:
        """Queue ``wanted``; how many requests wait on ``channel`` now (this one included):
        a host that is listening keeps that near 1, a long line says it is not."""
        ...

    async def pop(self, channel: str, *, wait_s: float) -> list[Wanted]:
        """The requests waiting on ``channel``, blocking up to ``wait_s`` for the first
        ([] if none came)."""
        ...

    async def close(self) -> None: ...
