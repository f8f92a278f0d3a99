"""The index port: a fast, rebuildable lookup plus coordination (nonces, deadlines,
idempotency keys, leases). Losing the index loses no session: the reconciler rebuilds it
from the object store.

The port is split by role (waits, timers, claims, leases, session registry, health) so
code can ask for only the role it uses; ``Index`` is all of them, as adapters provide it.
Every method that decides whether something has expired takes the caller's ``now``:
no adapter reads the wall clock, so a manual clock drives them all. The one exception is
lease expiry in an index shared by many hosts (Redis): there the index server's clock
decides, so hosts whose clocks disagree still agree on who holds a session; the ``now``
the lease methods take serves the single-process adapters."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from torpor.lifecycle import SessionState


class WaitBinding(BaseModel):
    """What the index knows about one open wait: enough to route a callback."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    correlation_id: str
    session_id: str
    epoch: int
    step_id: str
    deadline: datetime


@dataclass(frozen=True, slots=True)
class Lease:
    name: str
    owner: str
    token: int  # fencing token: strictly increasing per lease name
    expires_at: datetime
    # Set by ``acquire_lease`` when it took over a lease whose holder never released it
    # (it died, or was cut off): that holder may have committed the session's snapshot
    # without recording the new state in the registry, so the new holder records it.
    taken_over: bool = False


class IdempotencyStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    key: str
    session_id: str
    fingerprint: str
    status: IdempotencyStatus
    created: bool  # True if this call claimed the key; False if it already existed


class TimerKind(StrEnum):
    WAKE = "wake"  # inbox holds an event that no activation has confirmed yet
    POLL = "poll"  # a wait is overdue: ask the external system
    TOOL = "tool"  # a timer a wait's tool asked for (an approval's reminder or escalation)
    RETRY = "retry"  # an outbox entry or a failed activation is due for another try
    DELIVER = "deliver"  # an outbound notification is due for an attempt
    FANOUT = "fanout"  # a batch whose sessions are not all created yet (member: batch id)


@dataclass(frozen=True, slots=True)
class Admission:
    fresh: bool  # False: one of the replay claims was already taken
    binding: WaitBinding | None  # the wait the event resolves to (None if fresh is False)
    # The index's own clock at admission, where it has one shared by every replica (Redis
    # TIME): the event's received_at, so lateness does not depend on which replica took it.
    at: datetime | None = None


@dataclass(frozen=True, slots=True)
class SessionEntry:
    """What the session registry holds of one session. ``tenant`` is "" where it is not
    known: a poison quarantine whose header did not read, or (Redis) an entry an older
    torpor recorded, before the state hash carried the tenant."""

    tenant: str
    state: SessionState
    generation: int


@dataclass(frozen=True, slots=True)
class SessionPage:
    session_ids: list[str]
    next_cursor: str | None


class WaitIndex(Protocol):
    """Open waits: route a callback to its session, and find the overdue ones."""

    async def bind_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> bool:
        """Atomically: correlation id → binding, business key → correlation id, deadline
        into the SLA set. Entries expire at deadline + grace.

        The business key is taken only if no other session's wait holds it unexpired at
        ``now`` (the same session may take it over: a re-plan opens a new epoch of its own
        wait). False: another session holds it and keeps it; the wait is bound by its
        correlation id all the same."""
        ...

    async def resolve(
        self,
        *,
        tenant: str,
        now: datetime,
        correlation_id: str | None = None,
        business_key: str | None = None,
    ) -> WaitBinding | None:
        """Find a wait bound and unexpired at ``now`` by correlation id or business key,
        only within ``tenant``. By business key it is also the lookup of the key's owner
        (the binding names its session)."""
        ...

    async def unbind(
        self,
        *,
        tenant: str,
        correlation_id: str,
        business_key: str | None,
        deadline: datetime | None = None,
    ) -> None:
        """Remove a wait; the business-key pointer only if it still names this wait.
        ``deadline``: the wait's deadline as the caller knows it, a hint an index may use
        to do it in one step; a binding stored with another deadline goes all the same."""
        ...

    async def mend_wait(
        self, binding: WaitBinding, *, business_key: str | None, grace: timedelta, now: datetime
    ) -> int | None:
        """If the wait is bound, unexpired, exactly as ``binding``: put back what a partial
        loss of the index took from it (its deadline entry, and the business-key pointer
        when no one holds the key) and return how many entries that was. None if it is
        not bound so (gone, or bound anew since): nothing is changed. Never binds, so a
        caller holding an older copy of the session cannot bring back a closed wait."""
        ...

    async def due_deadlines(self, *, now: datetime, limit: int) -> list[WaitBinding]:
        """Waits whose deadline passed by ``now`` (earliest first); entries past deadline
        + grace are dropped instead."""
        ...


class TimerIndex(Protocol):
    """Timers by kind (wake, poll, retry, deliver): one entry per member, rescheduling moves it.

    A timer stands for work not yet done, so it is removed only once that work is
    confirmed: a taker *leases* due timers (``lease_due`` pushes them to a later due time
    in the same step) and removes one with ``unschedule(if_at=...)`` when its work is
    confirmed. A taker that dies, or whose work is dropped, leaves the timer to come due
    again."""

    async def schedule(
        self,
        *,
        kind: TimerKind,
        member: str,
        at: datetime,
        keep_earlier: bool = False,
        if_absent: bool = False,
    ) -> None:
        """Set the member's due time to ``at``; with ``keep_earlier`` an existing earlier
        due time stays (make sure a timer exists without delaying one); with
        ``if_absent`` an existing one stays whatever its time (make sure a timer exists
        without moving one: a backed-off poll, a leased timer)."""
        ...

    async def unschedule(
        self, *, kind: TimerKind, member: str, if_at: datetime | None = None
    ) -> None:
        """Remove the member; with ``if_at`` only if it is still due at exactly that time
        (nobody rescheduled it since it was leased)."""
        ...

    async def due(self, *, kind: TimerKind, now: datetime, limit: int) -> list[str]: ...

    async def lease_due(
        self, *, kind: TimerKind, now: datetime, limit: int, until: datetime
    ) -> list[str]:
        """Members due at ``now`` (earliest first), each moved to ``until`` atomically:
        taken, not removed."""
        ...


class ClaimIndex(Protocol):
    """First-claim-wins keys: webhook replay nonces and request idempotency keys."""

    async def admit(
        self,
        *,
        claims: list[tuple[str, str]],
        ttl: timedelta,
        now: datetime,
        tenant: str,
        correlation_id: str | None,
        business_key: str | None,
    ) -> Admission:
        """Claim every (scope, nonce) pair for ``ttl``, all or none, and resolve the wait
        together, in one round trip where the backend can: the webhook hot path. A refused
        claim resolves nothing."""
        ...

    async def release_nonce(self, *, scope: str, nonce: str) -> None:
        """Give a claim back (the request failed before anything was accepted)."""
        ...

    async def holds_nonce(self, *, scope: str, nonce: str, now: datetime) -> bool:
        """Whether a claim on (scope, nonce) is held and unexpired, claiming nothing (an
        ended console login, looked up on each of its cookie's requests)."""
        ...

    async def claim_idempotency(
        self,
        *,
        tenant: str,
        key: str,
        fingerprint: str,
        session_id: str,
        ttl: timedelta,
        now: datetime,
    ) -> IdempotencyRecord:
        """Claim ``key`` for ``session_id`` or return who holds it."""
        ...

    async def finish_idempotency(
        self, *, tenant: str, key: str, ttl: timedelta, now: datetime
    ) -> None: ...

    async def release_idempotency(self, *, tenant: str, key: str) -> None:
        """Forget a claim whose creation failed, so a retry can succeed."""
        ...


class LeaseIndex(Protocol):
    """Leases with fencing tokens: who runs a session, and whose holder died.

    A shared index decides expiry with its own server clock and ignores ``now``; only a
    single-process index (SQLite, memory) decides with the caller's ``now``."""

    async def acquire_lease(
        self, *, name: str, owner: str, ttl: timedelta, now: datetime
    ) -> Lease | None: ...

    async def renew_lease(self, lease: Lease, *, ttl: timedelta, now: datetime) -> Lease | None:
        """Extend a lease still held by ``lease.owner`` with ``lease.token``; None if lost."""
        ...

    async def raise_fence(
        self, lease: Lease, *, floor: int, ttl: timedelta, now: datetime
    ) -> Lease | None:
        """Re-issue a lease still held by ``lease.owner`` with ``lease.token`` under a new
        token above both the name's counter and ``floor``, and extend it; None if the lease
        is no longer ours. ``floor`` is the fence the session's snapshot recorded: after an
        index lost its counter (a flush), this puts the fence back above every token that
        ever committed, so a holder with an older token is refused at commit."""
        ...

    async def release_lease(self, lease: Lease) -> bool: ...

    async def expired_leases(self, *, now: datetime, limit: int) -> list[str]:
        """Names of leases that expired without being released (their holder died)."""
        ...

    async def forget_lease(self, *, name: str, now: datetime) -> None:
        """Drop a lease from the expiry set if it is still expired at ``now`` (its session
        was dealt with and nobody re-acquired it)."""
        ...

    async def drop_lease(self, *, name: str) -> None:
        """Forget a lease name for good: its record, its expiry entry and its fencing
        counter. Only for a name nothing takes again (a session retention purged): the
        counter outlives every release so that tokens only grow, and was kept for every
        session ever leased."""
        ...


class SessionRegistry(Protocol):
    """Session states for listings and batch progress; rebuildable from the snapshots."""

    async def record_session(
        self, *, tenant: str, session_id: str, state: SessionState, generation: int
    ) -> bool:
        """Record the state of snapshot ``generation``; an older generation never
        overwrites a newer one (repair and live commits may race). Listings are newest
        first: session ids begin with their creation time. Recorded (or lifted) under a
        tenant, a session is listed under tenant "" no more: the poison quarantine of a
        snapshot whose header did not decode either put it there, its tenant unknown.
        ``tenant`` "" (not known to the caller) keeps the tenant the registry holds, as
        ``record_poison`` does: an entry's tenant is never lost, and the session stays
        listed under it (Redis looks an older torpor's entry, which names no tenant, up
        in its listings); "" only for an entry that has none.

        True if it wrote; False if the registry holds a newer generation, which it kept.
        A caller that just committed ``generation`` then knows the index does not show
        its state: the QUARANTINED of a snapshot found undecodable, over which an older
        backup was restored, carries that snapshot's newer generation, and refuses every
        commit's record until one passes it (the activation lifts it with its lease's
        release instead: ``WorkingCopy.recorded``, ``release.let_go``)."""
        ...

    async def lift_quarantine(
        self,
        *,
        tenant: str,
        session_id: str,
        state: SessionState,
        generation: int,
        quarantined_at: int | None = None,
    ) -> bool:
        """Record ``state`` at ``generation`` only over a QUARANTINED the registry holds
        at a generation no newer, in one check-and-set; True if it did. For an activation
        that found the snapshot decodes after all (restored), which the index alone said
        it did not: any other state, or a newer generation, is left as it is. It takes
        effect before the calls asked for after it in the same turn (``let_go`` sends
        the lease's release after it), a server that lost its scripts included.

        ``quarantined_at``: over the QUARANTINED at exactly that generation instead, the
        one the caller read (``session_entry``), whatever ``generation`` is: for the
        operator's retry (``quarantine.retry``), and an activation that read the entry
        while it held the lease and found the store still holds the backup it read
        (``release._past_restore``). A poison quarantine's generation
        is the one its undecodable snapshot's header named; a backup restored from before
        it is older, and "newest wins" would keep it set aside for good. A quarantine
        recorded since the caller's read (a newer snapshot found undecodable) is not the
        one the operator looked at, and is left as it is.

        ``tenant``: the session's own, as the snapshot the caller decoded names it; it is
        written as named. Unlike ``record_session``, "" is not "not known" here: a lift
        is made only by a caller that read the snapshot. An entry that names another
        tenant is left as it is (False): a session's tenant never changes, and a lift
        under another would list it there. An entry under "" (a poison quarantine whose
        header did not read) or an older torpor's entry (which names none) takes it."""
        ...

    async def record_poison(self, *, tenant: str, session_id: str, generation: int) -> int:
        """Record QUARANTINED for a snapshot that does not decode, over whatever state the
        registry holds, in one step: at ``generation`` or the one it holds, whichever is
        newer; returns the generation recorded. The newest snapshot is unreadable, so no
        state the registry holds is true any more, and "newest wins" refused the record
        whenever the snapshot's header did not read (generation 0) or named an older
        generation than the one held (a restored backup that is spoiled too): the index
        kept a live state for a session nothing could read, which the operator's retry
        refused and the deadline loop asked to time out at every look. A later commit, or
        the operator's retry (``lift_quarantine``), replaces it as any quarantine. Under
        ``tenant`` as ``record_session`` records: a caller whose header did not say names
        the one the registry holds (``session_entry``), so the session stays listed there.
        ``tenant`` "" (not known to the caller) never takes a session out of the listing
        of the tenant the registry has it under: it is quarantined there, "" only if the
        registry has it under none (Redis looks an older torpor's entry, which names no
        tenant, up in its listings)."""
        ...

    async def session_states(self, session_ids: list[str]) -> dict[str, SessionState]: ...

    async def session_entry(self, session_id: str) -> SessionEntry | None:
        """The session's tenant, state and generation as recorded (None if unknown): what
        the control plane shows of a quarantined session whose header does not read."""
        ...

    async def quarantine_generation(self, session_id: str) -> int | None:
        """The generation of the QUARANTINED the registry holds for the session (None: it
        holds another state, or none). No tenant is looked up, and it is read in order
        with the calls asked for beside it in the same turn (one pipeline on Redis, the
        one writer thread on SQLite): ``release.let_go`` reads it after its lift and
        before the lease's release, and learns what refused the lift while the lease was
        still ours, at no round trip of its own."""
        ...

    async def forget_session(self, *, tenant: str, session_id: str) -> None:
        """Drop the session from the registry (retention deleted it). Idempotent."""
        ...

    async def session_generation(self, session_id: str) -> int | None:
        """The last recorded snapshot generation (None if unknown): one cheap index read
        that tells an event stream whether the snapshot changed at all."""
        ...

    async def list_sessions(
        self, *, tenant: str, state: SessionState | None, cursor: str | None, limit: int
    ) -> SessionPage: ...


class IndexHealth(Protocol):
    """Reachability, shutdown, and the marker that lets the reconciler notice a flushed
    or replaced index."""

    @property
    def url(self) -> str: ...

    async def ping(self) -> None:
        """Raise ``IndexUnavailable`` if the index cannot be reached."""
        ...

    async def close(self) -> None: ...

    async def begin_repair(self) -> str:
        """Note that a repair starts; a token for ``mark_intact``. The note is lost with
        the index, as the integrity marker is."""
        ...

    async def mark_intact(self, token: str) -> bool:
        """Mark the index intact, only if the note ``begin_repair`` gave ``token`` for is
        still there (else False: the index was lost again while the repair ran, and what
        it rebuilt before that is gone)."""
        ...

    async def is_intact(self) -> bool: ...

    async def record_sweep(self, *, at: datetime) -> None:
        """Remember when the reconciler last completed a sweep (``/healthz`` reads it)."""
        ...

    async def last_sweep(self) -> datetime | None:
        """When a sweep last completed; None if never (or since the index was lost)."""
        ...


class Index(WaitIndex, TimerIndex, ClaimIndex, LeaseIndex, SessionRegistry, IndexHealth, Protocol):
    """Every role at once: what an adapter provides and the dependency bag carries."""
