"""The activator port: gets a session activated somewhere (in this process, or on a Ray
actor), and the reasons a session is activated."""

from __future__ import annotations

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
