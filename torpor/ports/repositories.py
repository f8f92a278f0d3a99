"""Repositories the core and the application services work through (implemented in
``storage/``, one ``Object<Noun>`` adapter per ``<Noun>Repository`` port)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Collection
    from datetime import datetime, timedelta

    from pydantic import JsonValue

    from torpor.batches import BatchManifest, FanOutCursor, ResultLine, RetryGeneration
    from torpor.deliveries import Delivery, DeliveryStatus, EndpointState
    from torpor.events import InboxEvent
    from torpor.lifecycle import SessionState
    from torpor.models import SessionHeader, SessionSnapshot, WaitingSession
    from torpor.ports.index import WaitBinding


class SnapshotRepository(Protocol):
    async def create(self, snapshot: SessionSnapshot) -> SessionSnapshot:
        """Write generation 0, create-only; raise ``ObjectExists`` if the id is taken."""
        ...

    async def load(self, session_id: str) -> SessionSnapshot:
        """Raise ``SessionNotFound`` if there is no such session."""
        ...

    async def load_stored(self, session_id: str) -> SessionSnapshot:
        """The snapshot as stored: a long session's sealed history (its oldest messages,
        tool-log entries and processed event ids, in chunks) left out, so one read
        whatever its age. For reads of its state; never ``save`` it (``load`` for that).
        Raise ``SessionNotFound`` if there is no such session."""
        ...

    async def processed_events(self, session_id: str) -> list[str]:
        """Every event id the session processed (the sealed ones too), read without its
        conversation and tool log. Raise ``SessionNotFound`` if there is no such
        session, ``SnapshotCorrupt`` if they cannot be read."""
        ...

    async def load_waiting(self, session_id: str) -> WaitingSession:
        """What repair needs of the session (its waits, outbox and the processed event ids
        held in the snapshot), read without its conversation and tool log. Raise
        ``SessionNotFound`` if there is no such session."""
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

    def list_live(self, *, now: datetime) -> AsyncIterator[SessionHeader]:
        """Headers of the sessions that have not ended, at a cost that follows them and
        not every session ever stored."""
        ...

    def list_live_waiting(self, *, now: datetime) -> AsyncIterator[WaitingSession | SessionHeader]:
        """As ``list_live``, with what repair needs of each (``load_waiting``), each
        session's snapshot read once; one whose body cannot be read comes as its header
        (``load_waiting`` then says why)."""
        ...

    def list_ended(self, *, since: datetime, now: datetime) -> AsyncIterator[SessionHeader]:
        """Headers of the sessions that ended between ``since`` and ``now`` (by day)."""
        ...

    def list_by_state(
        self, states: Collection[SessionState] | None = None, *, concurrency: int = 16
    ) -> AsyncIterator[SessionHeader]:
        """Headers of every session (optionally only in ``states``); unreadable snapshots
        are skipped here, ``load`` reports them loudly."""
        ...


@dataclass
class RetentionReport:
    """What one retention pass did."""

    purged: list[tuple[str, str]] = field(default_factory=list)  # (tenant, session id)
    # Sessions an earlier pass purged whose ended marker still waits out its window: the
    # index forgets them again (idempotent), in case a kill or an index error came between
    # that pass's deletes and its forgetting them.
    forget: list[tuple[str, str]] = field(default_factory=list)
    kept: int = 0  # due, but something of theirs is still needed
    objects: int = 0  # objects deleted
    archived: int = 0  # audit blocks compacted into archives
    batches: int = 0  # batches deleted (their manifest and everything beside it)
    errors: list[str] = field(default_factory=list)  # what failed on its own (the rest went on)


class RetentionRepository(Protocol):
    """Deletes ended sessions, and every record of theirs, after the retention period."""

    async def sweep(
        self, *, now: datetime, keep: timedelta, windows: timedelta, limit: int
    ) -> RetentionReport:
        """Delete up to ``limit`` sessions that ended more than ``keep`` before ``now``,
        keeping any whose records a window of ``windows`` still needs."""
        ...


@dataclass(frozen=True, slots=True)
class Stored:
    """An inbox write whose outcome is known: ``new`` is False if the event was there
    already. ``durable()`` returns once it is on disk (at once if it was already)."""

    new: bool
    durable: Callable[[], Awaitable[None]]


class InboxRepository(Protocol):
    async def deliver(self, event: InboxEvent) -> bool:
        """Create-only; False if this (source, event id) was already delivered."""
        ...

    async def stage(self, event: InboxEvent) -> Stored:
        """``deliver``, returning as soon as the outcome is known and the event is
        visible, possibly before it is durable: the caller writes what the outcome
        decides (its audit record) and awaits ``durable()`` before answering, so that
        one flush of a local disk makes both durable."""
        ...

    async def pending(self, session_id: str, *, processed: Collection[str]) -> list[InboxEvent]:
        """Delivered events not yet in ``processed``, oldest first."""
        ...

    async def find(self, session_id: str, event_key: str) -> InboxEvent | None:
        """The delivered event with this key, if any."""
        ...

    async def remember_accepted(
        self,
        *,
        source: str,
        content_digest: str,
        at: datetime | None = None,
        in_inbox: bool = False,
    ) -> bool:
        """Record that the request with this signed content was accepted (the replay
        memory that outlives the index and any process crash; a power cut may take it on
        a local disk, which only turns a replay's 409 into a 200 duplicate, since the
        inbox dedups it), ``at`` the time it was received (retention deletes it by that).
        ``in_inbox``: the request stored an inbox event (which names the memory, and
        retention deletes the two together); otherwise retention must find it alone.
        Idempotent: True if this call recorded it, False if it was recorded already."""
        ...

    async def forget_accepted(self, *, source: str, content_digest: str) -> None:
        """Take back what ``remember_accepted`` recorded (only a caller whose call
        recorded it: the request failed after all). Idempotent."""
        ...

    async def was_accepted(self, *, source: str, content_digest: str) -> bool:
        """Whether ``remember_accepted`` recorded this content: one lookup."""
        ...


class CorrelationRepository(Protocol):
    """Durable correlation records in the object store: the index's source of truth."""

    async def record(self, binding: WaitBinding, *, business_key: str | None) -> None: ...

    async def record_business_key(self, binding: WaitBinding, *, business_key: str) -> None:
        """Point ``business_key`` at the binding's wait (after the index gave it the key)."""
        ...

    async def lookup(self, correlation_id: str) -> WaitBinding | None: ...

    async def lookup_business_key(
        self, *, tenant: str, business_key: str
    ) -> WaitBinding | None: ...

    async def business_key_target(self, *, tenant: str, business_key: str) -> str | None:
        """The correlation id the business key's pointer names (one read; its record
        not read)."""
        ...


class BatchRepository(Protocol):
    """Batch manifests (written once, before the sessions), their documents, the fan-out
    cursor, cancel marker, retry generations and results exports."""

    async def create(self, manifest: BatchManifest) -> bool:
        """Create-only: False if a manifest with this batch id already exists."""
        ...

    async def get(self, batch_id: str) -> BatchManifest:
        """Raise ``NotFound`` if there is no such (readable) batch."""
        ...

    async def mark_accepting(self, batch_id: str, at: datetime) -> None:
        """Note durably, before the batch's first document, that its documents are being
        written at ``at``: retention deletes those whose manifest never came."""
        ...

    async def mark_accepted(self, batch_id: str) -> None:
        """Remove that note: the manifest is written (it names the documents now)."""
        ...

    async def put_documents(
        self, batch_id: str, fingerprint: str, documents: list[JsonValue]
    ) -> str:
        """Write-once documents of one request (keyed by its fingerprint); their key."""
        ...

    async def documents(self, key: str) -> list[JsonValue]: ...

    async def put_document_ids(
        self, batch_id: str, fingerprint: str, ids: list[str | None]
    ) -> None:
        """Write-once ids of one request's documents (``document_id`` of each, in order)."""
        ...

    async def document_ids(self, batch_id: str, fingerprint: str) -> list[str | None] | None:
        """The ids ``put_document_ids`` wrote; None if it wrote none (a batch accepted
        before they were kept, or an accept that died between its documents and them)."""
        ...

    async def put_document(self, batch_id: str, index: int, document: JsonValue) -> str:
        """One document stored to be passed by reference; its key."""
        ...

    async def document(self, key: str) -> JsonValue:
        """A document passed by reference; ``NotFound`` if there is none at ``key``."""
        ...

    async def cursor(self, batch_id: str) -> FanOutCursor:
        """The fan-out cursor; at 0 if none was written yet."""
        ...

    async def save_cursor(self, batch_id: str, cursor: FanOutCursor) -> None: ...

    async def mark_fanning_out(self, batch_id: str) -> None:
        """Note durably that the batch's fan-out has not finished (before its manifest)."""
        ...

    async def mark_fanned_out(self, batch_id: str) -> None:
        """Remove that note: the fan-out finished, or there is nothing to fan out."""
        ...

    def fanning_out(self) -> AsyncIterator[str]:
        """The ids of the batches noted as fanning out (one listing page at a time)."""
        ...

    async def mark_cancelled(self, batch_id: str) -> None:
        """Idempotent: the batch stays cancelled."""
        ...

    async def is_cancelled(self, batch_id: str) -> bool: ...

    async def add_generation(self, batch_id: str, generation: RetryGeneration) -> bool:
        """Create-only: False if that generation exists already (a concurrent retry)."""
        ...

    async def generations(self, batch_id: str) -> list[RetryGeneration]: ...

    async def generation_count(self, batch_id: str) -> int:
        """``len(generations(batch_id))``, none of them read (what names an export)."""
        ...

    async def put_results_page(
        self, batch_id: str, page: int, lines: list[ResultLine], *, generation: int
    ) -> None:
        """Write page ``page`` of the export as of ``generation`` retries of the batch
        (its lines in document order; the pages are written in any order, again in full
        by an export that died before its end)."""
        ...

    async def seal_results(self, batch_id: str, *, generation: int, pages: int) -> None:
        """The export as of ``generation`` retries is whole: its ``pages`` pages written.
        Only after its last page: until then ``results`` does not find it."""
        ...

    async def results(
        self, batch_id: str, fmt: str, *, generation: int = 0
    ) -> AsyncIterator[bytes] | None:
        """The export in ``fmt`` (jsonl, parquet) as of ``generation`` retries, read and
        encoded a page at a time as it is iterated; None if it is not whole yet (or
        ``fmt`` is no format of it)."""
        ...


@dataclass(frozen=True, slots=True)
class SubmitKey:
    """What a submit's Idempotency-Key made: kept in the object store beside the index's
    claim, which a lost index takes with it."""

    session_id: str
    fingerprint: str
    created_at: datetime


class SubmitKeyRepository(Protocol):
    async def claim(self, *, tenant: str, key: str, record: SubmitKey, ttl: timedelta) -> SubmitKey:
        """Create-only: the record of ``key`` that holds: ``record`` if there was none,
        or if the one there is ``ttl`` old (the key may be used again), else that one."""
        ...


class DeliveryRepository(Protocol):
    """Delivery records of outbound notifications, and the state of their endpoints."""

    async def create(self, delivery: Delivery) -> bool:
        """Create-only: False if this delivery already exists (an outbox replay)."""
        ...

    async def get(self, tenant: str, delivery_id: str) -> Delivery:
        """Raise ``NotFound`` if there is no such delivery."""
        ...

    async def update(
        self, tenant: str, delivery_id: str, change: Callable[[Delivery], Delivery]
    ) -> Delivery:
        """Read, apply ``change``, compare-and-swap; retried if another writer won."""
        ...

    async def list(
        self,
        tenant: str,
        *,
        status: DeliveryStatus | None,
        cursor: str | None,
        limit: int,
        full: bool = False,
    ) -> tuple[list[Delivery], str | None]:
        """One page of a tenant's deliveries and the cursor of the next (None at the end).
        ``full``: read every delivery, not an index of those in ``status`` (deliveries
        stored before such an index existed are not in it)."""
        ...

    async def endpoint(self, tenant: str, url: str) -> EndpointState: ...

    async def set_endpoint(self, tenant: str, state: EndpointState) -> None: ...


class AuditRepository(Protocol):
    """The tamper-evident record of every webhook decision."""

    # False while the last write failed: every webhook then fails too, so the health
    # route reports it instead of staying green.
    healthy: bool

    async def append(
        self,
        *,
        verdict: str,
        at: datetime,
        source: str,
        body_sha256: str,
        event_id: str | None = None,
        session_id: str | None = None,
        correlation_id: str | None = None,
        signature: str | None = None,
        timestamp: datetime | None = None,
        trace_id: str | None = None,
        session_trace_id: str | None = None,
    ) -> object:
        """Returns once the record is durable. ``trace_id`` is the sender's,
        ``session_trace_id`` the trace of the session the request was routed to."""
        ...

    async def close(self) -> None:
        """Wait for appends still being written."""
        ...
