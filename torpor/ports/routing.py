"""How a long-running tool's far side answers, and how the submitter hears back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torpor.models import OutboxEntry, SessionSnapshot, Wait
    from torpor.tools import CallbackRoute


class CallbackRouter(Protocol):
    """Tells a long-running tool how the far side should answer."""

    def route(self, snapshot: SessionSnapshot, wait: Wait) -> CallbackRoute: ...


class Notifier(Protocol):
    """Accepts a notification for durable, retried delivery to the submitter."""

    async def enqueue(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None: ...
