"""Batches: one session per document, submitted together and followed as one.

The manifest is written first (create-only) and the sessions after it, in the background:
``session_ids`` are a function of the manifest (``batch_session_id``), so a fan-out that
resumes after a crash names each document's session again instead of making a second one.
A retry of failed documents makes a *generation*: document ``i``'s session in generation
``g`` is its attempt ``g``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from torpor.errors import InvalidRequest
from torpor.ids import batch_session_id
from torpor.lifecycle import SessionState

# States a retry of the batch's failed documents takes back.
RETRYABLE_STATES: frozenset[SessionState] = frozenset({SessionState.FAILED, SessionState.TIMED_OUT})
# A page of a batch's sessions (``sessions_page``), unless asked for another size, and the
# most one holds. A batch holds 10,000 documents: listed whole, each GET of it answered
# 10,000 ids (a third of a megabyte) while its caller polled only its progress.
SESSIONS_PAGE = 100
SESSIONS_PAGE_MAX = 1000


class BatchManifest(BaseModel):
    """The durable record of a batch: its request, and which session each document becomes.

    Manifests written before the fan-out moved behind the 202 list ``session_ids`` and
    have no ``total``; newer ones derive the ids (see :meth:`sessions`)."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str
    tenant: str
    agent: str
    session_ids: list[str] = Field(default_factory=list)
    created_at: datetime
    total: int = 0
    metadata: dict[str, str] = Field(default_factory=dict)
    callback_url: str | None = None
    fingerprint: str = ""  # of the request: the same Idempotency-Key with other documents
    documents_key: str | None = None  # the object holding the documents, in order
    max_running: int | None = None  # this batch's cap on RUNNING sessions (None: none)

    @property
    def size(self) -> int:
        return self.total or len(self.session_ids)

    @property
    def created_ms(self) -> int:
        return int(self.created_at.timestamp() * 1000)

    def session_id(self, index: int, attempt: int = 0) -> str:
        if self.session_ids and attempt == 0:
            return self.session_ids[index]
        return batch_session_id(self.batch_id, self.created_ms, index, attempt)

    def sessions(self) -> list[str]:
        """The first session of every document, in document order."""
        return self.session_ids or [self.session_id(i) for i in range(self.total)]


class FanOutCursor(BaseModel):
    """How far the fan-out got: every document below ``next`` has its session."""

    model_config = ConfigDict(extra="forbid")

    next: int = 0


class RetryGeneration(BaseModel):
    """One retry of a batch: the documents (by index) that get a new session."""

    model_config = ConfigDict(extra="forbid")

    generation: int  # >= 1; the documents' sessions are attempt ``generation``
    documents: list[int]
    created_at: datetime


@dataclass
class Attempts:
    """Which session is each document's current one, across retry generations."""

    manifest: BatchManifest
    latest: dict[int, int] = field(default_factory=dict)  # document index -> attempt

    @classmethod
    def of(cls, manifest: BatchManifest, generations: list[RetryGeneration]) -> Attempts:
        attempts = cls(manifest)
        for gen in sorted(generations, key=lambda g: g.generation):
            for doc in gen.documents:
                attempts.latest[doc] = gen.generation
        return attempts

    def current(self, index: int) -> str:
        return self.manifest.session_id(index, self.latest.get(index, 0))

    def all_current(self, upto: int | None = None) -> list[str]:
        n = self.manifest.size if upto is None else min(upto, self.manifest.size)
        return [self.current(i) for i in range(n)]

    def between(self, start: int, end: int) -> list[str]:
        """The current sessions of documents ``start`` up to ``end`` (not included)."""
        return [self.current(i) for i in range(start, min(end, self.manifest.size))]

    def ranks(self) -> dict[str, int]:
        """Each document's current session -> the document's index (its place in the
        batch's queue for a running slot)."""
        return {sid: i for i, sid in enumerate(self.all_current())}


@dataclass(frozen=True)
class BatchProgress:
    batch_id: str
    total: int
    by_state: dict[str, int]
    created: int = -1  # documents whose session exists (-1: all of them)
    cancelled: bool = False
    eta_s: float | None = None  # at the rate so far; None until something finished
    # Documents whose session ended and was deleted by retention (in none of by_state).
    purged: int = 0

    @property
    def done(self) -> int:
        return self.purged + sum(n for s, n in self.by_state.items() if SessionState(s).terminal)

    @property
    def finished(self) -> bool:
        return self.done == self.total


@dataclass(frozen=True)
class SessionsPage:
    """Some of a batch's documents' current sessions, in document order from ``start``;
    ``next_cursor`` asks for the page after it (None: this one is the last)."""

    start: int
    session_ids: list[str]
    next_cursor: str | None


def sessions_page(attempts: Attempts, *, cursor: str | None, limit: int) -> SessionsPage:
    """The page of the batch's sessions ``cursor`` names (None: the first), ``limit`` of
    them at most. ``InvalidRequest`` for a limit out of range or a cursor no page of this
    batch hands out. The cursor is the index of the page's first document, as text: a
    batch's documents never change, so a cursor stays good for the batch's whole life."""
    if not 1 <= limit <= SESSIONS_PAGE_MAX:
        raise InvalidRequest(f"limit: from 1 to {SESSIONS_PAGE_MAX}, not {limit}")
    total = attempts.manifest.size
    start = _cursor_start(cursor, total=total)
    end = min(start + limit, total)
    return SessionsPage(start, attempts.between(start, end), str(end) if end < total else None)


def _cursor_start(cursor: str | None, *, total: int) -> int:
    if cursor is None:
        return 0
    # ASCII digits only (``isdigit`` takes "²" too, which int() refuses), and short: a
    # number of a thousand digits must not be parsed to be refused.
    if cursor.isascii() and cursor.isdigit() and len(cursor) <= 9 and int(cursor) < total:
        return int(cursor)
    raise InvalidRequest(f"cursor: {cursor[:40]!r} is not a cursor of this batch's sessions")


def document_id(document: JsonValue) -> str | None:
    """The document's own ``"id"`` as its result line names it (None: it has none). A
    string as it is, an integer in decimal; any other value, which only a batch accepted
    before ids were checked (``id_refusal``) can hold, as its JSON text (``true``, not
    Python's ``True``), as every reader of the results parses it."""
    raw = document.get("id") if isinstance(document, dict) else None
    if raw is None:
        return None
    return raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True)


def id_refusal(documents: Iterable[JsonValue]) -> str | None:
    """Why a batch's document ids are refused, or None: an id is a string or an integer
    (or absent, or null), and names one document only. Ids are compared as the results
    write them, so ``1`` and ``"1"`` are one id: two result lines with one
    ``document_id`` leave a reader unable to tell whose result is whose."""
    seen: dict[str, int] = {}
    for i, document in enumerate(documents):
        raw = document.get("id") if isinstance(document, dict) else None
        if raw is None:
            continue
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            return f"documents[{i}].id: a string or an integer, not {json.dumps(raw)[:80]}"
        key = raw if isinstance(raw, str) else str(raw)  # as ``document_id`` writes it
        if key in seen:
            return (
                f"documents[{i}].id {key[:80]!r} is also documents[{seen[key]}].id: ids are unique"
            )
        seen[key] = i
    return None


def eta_seconds(*, total: int, done: int, elapsed_s: float) -> float | None:
    """Seconds until ``total`` at the average rate so far; None before a first result."""
    if done <= 0 or elapsed_s <= 0:
        return None
    if done >= total:
        return 0.0
    return (total - done) * (elapsed_s / done)


class ResultLine(BaseModel):
    """One document's outcome, as the results export writes it (a JSONL line, a row)."""

    model_config = ConfigDict(extra="forbid")

    index: int
    document_id: str | None = None  # the document's own "id", when it has one
    session_id: str
    state: SessionState | None  # None: retention deleted the session before the export
    result: JsonValue = None
    error: str | None = None
