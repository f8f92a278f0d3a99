"""Repositories the session runtime works through (implemented in ``storage/``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Collection

    from torpor.events import InboxEvent
    from torpor.lifecycle import SessionState
    from torpor.models import SessionHeader, SessionSnapshot
    from torpor.ports.index import WaitBinding


class SnapshotRepository(Protocol):
    async def create(self, snapshot: SessionSnapshot) -> SessionSnapshot:
        """Write generation 0, create-only; raise ``ObjectExists`` if the id is taken."""
        ...

    async def load(self, session_id: str) -> SessionSnapshot:
        """Raise ``SnapshotNotFound`` if there is no such session."""
        ...

    async def save(self, snapshot: SessionSnapshot, *, expected_generation: int) -> SessionSnapshot:
        """Compare-and-swap: write ``snapshot`` as generation ``expected_generation + 1``
        only if the stored one is still ``expected_generation``; else ``CommitConflict``
        and nothing is written. Returns the snapshot as stored."""
        ...

    def release(self, session_id: str) -> None:
        """Forget anything cached about the session (its activation ended)."""
        ...

    async def header(self, session_id: str) -> SessionHeader:
        """The small plain header of the stored snapshot (a ranged read)."""
        ...

    def list_by_state(
        self, states: Collection[SessionState] | None = None, *, concurrency: int = 16
    ) -> AsyncIterator[SessionHeader]:
        """Headers of every session (optionally only in ``states``); unreadable snapshots
        are skipped here, ``load`` reports them loudly."""
        ...


class InboxRepository(Protocol):
    async def deliver(self, event: InboxEvent) -> bool:
        """Create-only; False if this (source, event id) was already delivered."""
        ...

    async def pending(self, session_id: str, *, processed: Collection[str]) -> list[InboxEvent]:
        """Delivered events not yet in ``processed``, oldest first."""
        ...


class CorrelationRepository(Protocol):
    """Durable correlation records in the object store: the index's source of truth."""

    async def record(self, binding: WaitBinding, *, business_key: str | None) -> None: ...

    async def lookup(self, correlation_id: str) -> WaitBinding | None: ...

    async def lookup_business_key(
        self, *, tenant: str, business_key: str
    ) -> WaitBinding | None: ...
