"""The working copy of one session's snapshot, and its compare-and-swap commit.

An activation owns a working copy while its runtime holds the session's lease. Every
change reaches storage through ``commit``, a compare-and-swap on the generation: if anyone
else committed meanwhile the activation stops with ``CommitConflict`` and changes nothing.
Checkpoints happen at every tool boundary, so a crash loses at most the step in flight,
and the step's idempotency key makes its replay safe.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar, cast

from pydantic import JsonValue

from torpor import outbox
from torpor.errors import LeaseLost
from torpor.events import EventKind, InboxEvent
from torpor.lifecycle import SessionState, transition
from torpor.models import SessionSnapshot
from torpor.plugins import LoadedAgent
from torpor.ports.services import Services
from torpor.session.heartbeat import Heartbeat

T = TypeVar("T")


@dataclass
class Stats:
    """What one activation did, for its result and the metrics."""

    applied: int = 0
    observed: int = 0
    agent_steps: int = 0
    first_step_at: datetime | None = None
    drifts: int = 0


class StopActivation(BaseException):
    """Ends an activation early after a checkpoint (e.g. a retry was scheduled).

    A BaseException on purpose: an agent's or tool's ``except Exception`` must not swallow
    it on its way out."""


def error_result(exc: Exception | str, code: str = "tool_error") -> JsonValue:
    """How a failed call is shown to the agent: as data it can branch or re-plan on."""
    if isinstance(exc, Exception):
        code = str(getattr(exc, "code", code))
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = exc
    return {"error": {"code": code, "message": message[:1000]}}


def message_content(value: JsonValue, *, quote_json_text: bool = False) -> str:
    """A tool result as the text of a tool message: a str as it is, so a model reads the
    tool's own text; anything else as JSON.

    ``quote_json_text``, for an agent that reads the content back as JSON (the plan
    agent, ``reads_tool_results_as_json``): a str that JSON reads as something else goes
    as JSON too, so it comes back the str the tool returned (sent as it was, "123" came
    back as the number 123, "true" as True). A model is not given the tool's JSON text
    quoted and escaped."""
    if isinstance(value, str) and not (quote_json_text and _reads_as_json(value)):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def quotes_json_text(loaded: LoadedAgent | None) -> bool:
    """Whether ``loaded``'s agent reads tool messages back as JSON (``message_content``)."""
    agent = loaded.agent if loaded is not None else None
    return bool(getattr(agent, "reads_tool_results_as_json", False))


def _reads_as_json(text: str) -> bool:
    # ``json.loads`` itself, as the reader uses it: it also takes NaN, Infinity and
    # surrounding whitespace, which a narrower test would let through as text.
    try:
        json.loads(text)
    except ValueError:
        return False
    except RecursionError:  # nesting too deep to parse: encoded, a reader parses it as a str
        return True
    return True


async def _together(step: Awaitable[T], beside: Awaitable[None]) -> T:
    """Both run to their end at once; then the first one's error, if either failed, else
    what ``step`` returned."""
    outcome, other = await asyncio.gather(step, beside, return_exceptions=True)
    for failed in (outcome, other):
        if isinstance(failed, BaseException):
            raise failed
    return cast(T, outcome)


class WorkingCopy:
    """The snapshot an activation changes in memory, committed only under its lease."""

    def __init__(self, deps: Services, snapshot: SessionSnapshot, heartbeat: Heartbeat) -> None:
        self.deps = deps
        self.snap = snapshot
        self.heartbeat = heartbeat
        self.stats = Stats()
        self._committed_state = snapshot.state
        # Whether a commit recorded its state in the index's registry (the record was
        # written, not refused for a newer generation): if none did, the registry may
        # still hold what the index alone said before (``SessionRuntime``).
        self.recorded = False
        # When this activation last read the session's inbox (``time.monotonic``; never:
        # -inf): the agent loop reads it again for a cancel only once a while has passed.
        self.inbox_read_at = float("-inf")

    @property
    def now(self) -> datetime:
        return self.deps.clock.now()

    async def pending_cancel(self) -> InboxEvent | None:
        """The cancel waiting in the session's inbox, if one does (read now)."""
        self.inbox_read_at = time.monotonic()
        events = await self.deps.inbox.pending(
            self.snap.session_id, processed=set(self.snap.processed_events)
        )
        return next((e for e in events if e.kind is EventKind.CANCEL), None)

    def state(self) -> SessionState:
        return self.snap.state

    async def commit(self, *, beside: Callable[[], Awaitable[None]] | None = None) -> None:
        """Write the working copy if nobody else wrote since we loaded or last committed.

        ``beside``: what the caller does next once the snapshot is written (unbind the
        waits it closed), started with the registry's record of the new state, so that
        the two share one round trip to the index; both run, and the first error is
        raised."""
        if self.heartbeat.lapsed():
            raise LeaseLost(f"lease on {self.snap.session_id} was lost; not committing")
        token = self.heartbeat.lease.token
        if token < self.snap.lease_fence:
            # Fencing: a holder after us committed with a higher token, so ours is stale
            # (its lease expired, or the index lost its counter and issued it again). The
            # generation compare-and-swap below makes the stored fence the one we compare
            # against: a snapshot saved since we loaded fails the swap anyway.
            raise LeaseLost(
                f"fenced out of {self.snap.session_id}: token {token} is below the stored "
                f"fence {self.snap.lease_fence}; not committing"
            )
        draft = self.snap.model_copy(
            update={
                "lease_fence": token,
                "updated_at": self.now,
                "outbox": outbox.trim(self.snap.outbox),
            }
        )
        self.snap = await self.deps.snapshots.save(draft, expected_generation=self.snap.generation)
        if self.snap.state is self._committed_state:
            if beside is not None:
                await beside()
            return
        previous, self._committed_state = self._committed_state, self.snap.state
        recording = self.deps.index.record_session(
            tenant=self.snap.tenant,
            session_id=self.snap.session_id,
            state=self.snap.state,
            generation=self.snap.generation,
        )
        written = await (recording if beside is None else _together(recording, beside()))
        # Only a record the registry took: one it refused (it holds a newer generation:
        # the QUARANTINED of a snapshot an older backup replaced) leaves the registry
        # saying what it said, and the lease's release lifts that (``SessionRuntime``).
        self.recorded = self.recorded or written
        await self.deps.observer.transitioned(self.snap, previous)

    def move(self, target: SessionState, reason: str = "") -> None:
        """A lifecycle transition of the working copy (checked by the state machine)."""
        self.snap = transition(self.snap, target, now=self.now, reason=reason)

    def update(self, **fields: Any) -> None:
        self.snap = self.snap.model_copy(update=fields)
