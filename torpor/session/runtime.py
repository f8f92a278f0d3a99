"""SessionRuntime: activate a session under its lease, the same code on every host.

``activate`` takes the session's lease (with a fencing token), loads the snapshot, runs
one ``Activation`` and releases the lease. The snapshot records the fence of every commit
and a commit below it is refused, so the fence is seeded from the snapshot whenever the
index's counter is behind it (the index was flushed): tokens keep growing across index
loss. Two activations of one session can never both
commit: the lease keeps a second one out while the first is healthy, and the generation
compare-and-swap stops a stale holder whose lease expired behind its back (also across
two Ray clusters sharing one store).

After releasing the lease the runtime looks at the inbox once more: an event delivered
while the lease was held found the session busy, and this re-check is what guarantees it
is still applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from torpor import logs, tracing
from torpor.errors import (
    CommitConflict,
    LeaseLost,
    PluginNotFound,
    SessionNotFound,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotSchemaTooNew,
    TorporError,
)
from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot
from torpor.plugins import LoadedAgent
from torpor.ports import Reason, TimerKind
from torpor.ports.services import Services
from torpor.session.activation import Activation
from torpor.session.heartbeat import Heartbeat
from torpor.session.outcome import ActivationOutcome, ActivationResult, result_of
from torpor.session.release import let_go
from torpor.session.retry import Retrier, retry_delay
from torpor.session.slots import leave_slot
from torpor.session.working import StopActivation, WorkingCopy
from torpor.transient import transient

MAX_ROUNDS = 8
RETRY_AT_CAP = 62  # a backoff attempt far past any cap: the capped delay, with jitter
log = logging.getLogger(__name__)


def lease_name(session_id: str) -> str:
    return f"session:{session_id}"


class SessionRuntime:
    """Runs activations of any session under its lease; one per process and owner."""

    def __init__(self, deps: Services, *, owner: str) -> None:
        self.deps = deps
        self.plugins = deps.plugins
        self.owner = owner

    async def activate(
        self, session_id: str, *, reason: Reason = Reason.EVENT, requested_at: float | None = None
    ) -> ActivationResult:
        """Activate until the inbox holds nothing this session has not seen."""
        with (
            logs.bind(session_id=session_id),
            tracing.span(
                "torpor.activation",
                **{"torpor.session_id": session_id, "torpor.reason": reason.value},
            ),
        ):
            result = await self._activate(session_id, reason, requested_at)
        if result.outcome is not ActivationOutcome.BUSY:
            # BUSY: the activation holding the lease gives the slot back when it ends.
            await leave_slot(self.deps, session_id, result.state)
        return result

    async def _activate(
        self, session_id: str, reason: Reason, requested_at: float | None
    ) -> ActivationResult:
        result = ActivationResult(session_id, ActivationOutcome.BUSY)
        for _ in range(MAX_ROUNDS):
            result, snapshot = await self._leased(session_id, reason, requested_at)
            requested_at = None
            if result.outcome is not ActivationOutcome.RAN or snapshot is None:
                return result
            if snapshot.state is SessionState.QUARANTINED:
                # Set aside: events wait in the inbox for the operator's retry, and no
                # re-check, wake-up or retry timer brings the session round meanwhile.
                for kind in (TimerKind.WAKE, TimerKind.RETRY):
                    await self.deps.index.unschedule(kind=kind, member=session_id)
                return result
            # The wake-up was unscheduled with the lease's release (``release.let_go``),
            # and only now we look: an event written after our look schedules its own
            # wake-up after our unschedule, so none is ever orphaned.
            pending = await self.deps.inbox.pending(
                session_id, processed=set(snapshot.processed_events)
            )
            if not pending:
                return result
            reason = Reason.EVENT
        return result

    async def _leased(
        self, session_id: str, reason: Reason, requested_at: float | None
    ) -> tuple[ActivationResult, SessionSnapshot | None]:
        config, clock, index = self.deps.config, self.deps.clock, self.deps.index
        # The snapshot is read while the lease is taken: one wait instead of two. A read
        # that races another holder's last commit is only stale, never wrong: the first
        # commit on it fails its compare-and-swap (a conflict, retried), as any would.
        loading = asyncio.ensure_future(self.deps.snapshots.load(session_id))
        try:
            lease = await index.acquire_lease(
                name=lease_name(session_id), owner=self.owner, ttl=config.lease_ttl, now=clock.now()
            )
        except BaseException:
            await _discard(loading)
            raise
        if lease is None:
            await _discard(loading)
            return ActivationResult(session_id, ActivationOutcome.BUSY), None
        heartbeat = Heartbeat(
            index, lease, clock=clock, period=config.heartbeat_period, ttl=config.lease_ttl
        ).start()
        activation: Activation | None = None
        outcome = ActivationOutcome.RAN
        # Who brings the session back if this activation does not finish: a released lease
        # needs a retry timer; a lease left alone expires and the reconciler recovers it.
        release = False
        # Whether the session's wake-up timer goes with the lease (a drive that ran to its
        # end, the session not set aside): ``_activate`` then looks at the inbox once more.
        ran = False
        # A lease taken over is the one sign that its last holder may have left the
        # registry stale, told to its first next holder only: until the state is recorded
        # it is not released (it expires, and whoever recovers it is told again).
        recorded = not lease.taken_over
        # What a drive that ran to its end left with no state recorded (nothing to commit,
        # or every record refused: a QUARANTINED at a newer generation, the undecodable
        # snapshot's, over an older backup restored): the registry may still say the
        # QUARANTINED of ``_quarantine_poison`` (``release.let_go`` lifts it).
        unrecorded: SessionSnapshot | None = None
        took_over_recorded = False  # the taken-over lease's record of the state, written
        try:
            try:
                snapshot = await loading
            except SessionNotFound:
                release = True
                # Gone (retention purged it; a callback may have armed its wake-up since):
                # nothing will ever run it, so no timer stays to ask again for ever.
                for kind in (TimerKind.WAKE, TimerKind.RETRY):
                    await self.deps.index.unschedule(kind=kind, member=session_id)
                return ActivationResult(session_id, ActivationOutcome.MISSING), None
            except SnapshotSchemaTooNew as exc:
                # Not recorded (nothing here reads its state): a lease taken over is kept
                # until it expires, so the newer torpor that takes it next is told.
                release = recorded
                return await self._leave_to_newer(session_id, exc), None
            except SnapshotCorrupt as exc:
                release = True
                return await self._quarantine_poison(session_id, exc, heartbeat), None
            logs.update(trace_id=snapshot.trace_id)
            if lease.taken_over:
                # Its last holder died holding the lease, perhaps between a commit and the
                # registry's record of the state it committed (the next round trip): the
                # registry would show the old state until a full repair. Recorded now;
                # the registry keeps the highest generation, so this never goes back.
                # Refused, a newer generation stands (a quarantine over a restored older
                # backup): not stale, so the lease may go, but the drive's end lifts it.
                took_over_recorded = await index.record_session(
                    tenant=snapshot.tenant,
                    session_id=session_id,
                    state=snapshot.state,
                    generation=snapshot.generation,
                )
                recorded = True
            if snapshot.lease_fence >= heartbeat.lease.token:
                # The index handed out a token some holder already committed with: it lost
                # its fencing counter (flushed). Seed it from the snapshot, which survives.
                await heartbeat.refence(snapshot.lease_fence)
            activation = Activation(self.deps, snapshot, heartbeat, self._agent(snapshot))
            await self._drive_capped(activation, reason)
            release = True
            ran = activation.snap.state is not SessionState.QUARANTINED
            # Not past a lapsed lease: a holder since may have found the snapshot does not
            # decode (again), and its record stands.
            if ran and not (took_over_recorded or activation.work.recorded or heartbeat.lapsed()):
                unrecorded = activation.snap
        except (CommitConflict, LeaseLost) as exc:
            # Someone else wrote or holds the session. If they finish its work, the retry
            # finds nothing to do; if they vanished, the retry picks it up again.
            outcome = (
                ActivationOutcome.CONFLICT
                if isinstance(exc, CommitConflict)
                else ActivationOutcome.LEASE_LOST
            )
            await self._retry_soon(session_id)
            release = True
        except StopActivation:
            outcome, release = ActivationOutcome.STOPPED, True
        except Exception as exc:
            release = recorded
            if activation is None or _passing(exc):
                # Storage trouble mid-run: schedule the retry, and only then let the lease go.
                await self._retry_soon(session_id)
                raise
            release = True
            # A fault on the session's own path (a bug of ours or of a plugin, outside
            # what the agent loop turns into the agent's information; ``_passing``):
            # retried on every sweep for ever, it would hold the session RUNNING with no
            # one told. It is counted against the session's retry quota instead, with
            # its backoff, and set aside for an operator once the quota is spent.
            log.exception("activation of %s failed", session_id)
            return await self._crashed(session_id, heartbeat, exc), None
        finally:
            # A BaseException (the process is being stopped, the task cancelled) keeps the
            # lease: it expires after the TTL and the reconciler re-activates the session
            # from its last checkpoint, which a released lease would never trigger.
            self.deps.snapshots.release(session_id)
            await heartbeat.stop()
            if release:
                await let_go(
                    self.deps.index,
                    heartbeat,
                    session_id,
                    unschedule=ran,
                    lift=unrecorded,
                    snapshots=self.deps.snapshots,
                )
        assert activation is not None
        return result_of(activation, outcome, requested_at), activation.snap

    async def _drive_capped(self, activation: Activation, reason: Reason) -> None:
        """Drive within the activation wall-time cap. A hung call would otherwise keep the
        heartbeat renewing the lease for ever: past the cap the drive is cancelled (the
        last tool-boundary checkpoint stands), a retry is scheduled and the lease let go."""
        cap = asyncio.timeout(self.deps.config.activation_cap.total_seconds())
        try:
            async with cap:
                await activation.drive(reason)
        except TimeoutError:
            if not cap.expired():
                raise  # someone else's timeout, not the cap
            session_id = activation.snap.session_id
            log.warning("activation of %s ran past its wall-time cap; retrying later", session_id)
            await self._retry_soon(session_id)
            raise StopActivation("activation wall-time cap") from None

    async def _leave_to_newer(self, session_id: str, exc: SnapshotSchemaTooNew) -> ActivationResult:
        """A newer torpor wrote this snapshot (a rolling upgrade): it is not poison, only
        not ours to read. Retry at the backoff's cap, not every sweep, so a newer process,
        or this one once upgraded, takes it; its header does not read either, so nothing
        here could record a quarantine that a later commit would not contradict."""
        log.warning("session %s waits for a newer torpor: %s", session_id, exc)
        at = self.deps.clock.now() + retry_delay(self.deps.config, RETRY_AT_CAP)
        await self.deps.index.schedule(kind=TimerKind.RETRY, member=session_id, at=at)
        # The retry timer alone brings it back: a wake-up left armed (an answer's, or the
        # sweep's net under its retry) would ask every ``wake_grace_s`` instead, for as
        # long as no newer torpor takes it.
        await self.deps.index.unschedule(kind=TimerKind.WAKE, member=session_id)
        return ActivationResult(session_id, ActivationOutcome.STOPPED)

    async def _quarantine_poison(
        self, session_id: str, exc: SnapshotCorrupt, heartbeat: Heartbeat
    ) -> ActivationResult:
        """A snapshot that cannot be decoded cannot be rewritten either: the quarantine is
        recorded in the index's session registry (state QUARANTINED, which repair and the
        timers leave alone), and its reason is the decode error, found again on every read.
        No retry timer: retrying a permanent error changes nothing until an operator acts
        (``SessionService.retry``, e.g. after restoring the object)."""
        index = self.deps.index
        try:
            header = await self.deps.snapshots.header(session_id)
            tenant, generation = header.tenant, header.generation
        except SnapshotError:
            # Not even the header reads: under the tenant the index holds (a session's
            # tenant never changes, so a read before the write is as good as one in it),
            # "" if it holds none; at the generation it holds (``record_poison``).
            entry = await index.session_entry(session_id)
            tenant, generation = (entry.tenant if entry else ""), 0
        # Only while the lease is still ours, checked last: ``record_poison`` writes over
        # any state, and nothing fences it. A holder whose lease lapsed while it read (a
        # slow read, a stalled process) may hold bytes from before a restore; since then
        # the operator took the session back and a new holder recorded a newer state,
        # which a quarantine written now would hide (set aside again, its timers gone,
        # its snapshot readable). A holder after us that finds it undecodable records the
        # quarantine itself. The renewal makes the lease ours for a TTL, which the next
        # round trip is well within; the registry cannot check the lease in the same step
        # (``SessionRegistry`` has no record fenced by a lease).
        if not await heartbeat.confirm():
            log.warning(
                "session %s did not decode, but its lease lapsed: no quarantine recorded (%s)",
                session_id,
                exc,
            )
            return ActivationResult(session_id, ActivationOutcome.LEASE_LOST)
        log.error("session %s is quarantined: %s", session_id, exc)
        # Over whatever state the index holds, at any generation: the newest snapshot is
        # unreadable, so that state is true no more. Refused by "newest wins" (a header
        # that did not read, or named an older generation), the index kept a live state:
        # the operator's retry was refused and the deadline loop asked for a timeout at
        # every look, an activation each, failing again.
        generation = await index.record_poison(
            tenant=tenant, session_id=session_id, generation=generation
        )
        for kind in (TimerKind.RETRY, TimerKind.WAKE):  # nothing but an operator brings it back
            await self.deps.index.unschedule(kind=kind, member=session_id)
        return ActivationResult(
            session_id,
            ActivationOutcome.QUARANTINED,
            state=SessionState.QUARANTINED,
            generation=generation,
        )

    async def _crashed(
        self, session_id: str, heartbeat: Heartbeat, exc: Exception
    ) -> ActivationResult:
        """Count a failed activation against the quota, on the last committed snapshot
        (what the failed one changed in memory is dropped, as a crash would drop it):
        a retry after the quota's backoff, or QUARANTINED with the error once it is
        spent. If even that fails, the plain retry as for storage trouble."""
        stopped = ActivationResult(session_id, ActivationOutcome.STOPPED)
        try:
            snapshot = await self.deps.snapshots.load(session_id)
            if snapshot.state is SessionState.QUARANTINED:
                return stopped  # set aside already: only an operator brings it back
            if snapshot.terminal:
                # No quota to count against (its outbox is what runs): retried as before.
                await self._retry_soon(session_id)
                return stopped
            work = WorkingCopy(self.deps, snapshot, heartbeat)
            with contextlib.suppress(StopActivation):
                await Retrier(work).later("activation_failed", f"{type(exc).__name__}: {exc}")
            state, generation = work.snap.state, work.snap.generation
            # The retry timer (after the backoff) brings it back, or, set aside, only an
            # operator: ``Retrier`` dropped the wake-up (kept only for a cancel that came
            # meanwhile) and, setting it aside, the retry timer too.
        except Exception:
            log.exception("the failed activation of %s could not be counted", session_id)
            await self._retry_soon(session_id)
            return stopped
        outcome = (
            ActivationOutcome.QUARANTINED
            if state is SessionState.QUARANTINED
            else ActivationOutcome.STOPPED
        )
        return ActivationResult(session_id, outcome, state=state, generation=generation)

    async def _retry_soon(self, session_id: str) -> None:
        at = self.deps.clock.now() + self.deps.config.retry_delay
        await self.deps.index.schedule(kind=TimerKind.RETRY, member=session_id, at=at)

    def _agent(self, snapshot: SessionSnapshot) -> LoadedAgent | None:
        try:
            return self.plugins.agent(snapshot.agent.name)
        except PluginNotFound:
            return None


def _passing(exc: BaseException) -> bool:
    """Whether ``exc`` is retried as it is, never counted: any error torpor raises on
    purpose (a store or index that did not answer; a conditional write whose answer was
    lost, which the retry sorts out, and which, counted, would set aside sessions whose
    store is merely unsteady), trouble that passes by itself (``torpor.transient``: a
    network call refused or timed out, a client's transport error), or an error raised
    ``from`` either. What is left is a fault: a bug."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TorporError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return transient(exc)


async def _discard(loading: asyncio.Future[SessionSnapshot]) -> None:
    """A snapshot read nobody will use: stopped, and its outcome (an error) not reported."""
    loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
