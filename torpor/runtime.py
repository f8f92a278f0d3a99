"""SessionRuntime: activate a session under its lease, the same code on every host.

``activate`` takes the session's lease (with a fencing token), loads the snapshot, runs
one ``Activation`` and releases the lease. Two activations of one session can never both
commit: the lease keeps a second one out while the first is healthy, and the generation
compare-and-swap stops a stale holder whose lease expired behind its back (also across
two Ray clusters sharing one store).

After releasing the lease the runtime looks at the inbox once more: an event delivered
while the lease was held found the session busy, and this re-check is what guarantees it
is still applied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from torpor.activation import Activation, StopActivation
from torpor.errors import (
    CommitConflict,
    IndexUnavailable,
    LeaseLost,
    PluginNotFound,
    SnapshotNotFound,
)
from torpor.heartbeat import Heartbeat
from torpor.lifecycle import WAITING_STATES, SessionState
from torpor.models import ErrorInfo, SessionSnapshot
from torpor.plugins import LoadedAgent
from torpor.ports import Reason, TimerKind
from torpor.ports.services import Services

MAX_ROUNDS = 8


class Outcome(StrEnum):
    RAN = "ran"  # the activation ran and committed what it did
    BUSY = "busy"  # another activation holds the lease; it will see our events
    CONFLICT = "conflict"  # someone else committed first; nothing was written
    LEASE_LOST = "lease_lost"
    MISSING = "missing"  # no such session
    STOPPED = "stopped"  # ended early after a checkpoint (a retry is scheduled)


@dataclass(frozen=True)
class ActivationResult:
    session_id: str
    outcome: Outcome
    state: SessionState | None = None
    generation: int | None = None
    applied: int = 0
    observed: int = 0
    agent_steps: int = 0
    drifts: int = 0
    # Seconds from the request (caller's wall clock) to the first agent step, if any.
    resume_latency_s: float | None = None


def lease_name(session_id: str) -> str:
    return f"session:{session_id}"


class SessionRuntime:
    def __init__(self, deps: Services, *, owner: str) -> None:
        self.deps = deps
        self.plugins = deps.plugins
        self.owner = owner

    async def activate(
        self, session_id: str, *, reason: Reason = Reason.EVENT, requested_at: float | None = None
    ) -> ActivationResult:
        result = ActivationResult(session_id, Outcome.BUSY)
        for _ in range(MAX_ROUNDS):
            result, snapshot = await self._leased(session_id, reason, requested_at)
            requested_at = None
            if result.outcome is not Outcome.RAN or snapshot is None:
                return result
            # Unschedule the wake-up first, then look: an event written after our look
            # schedules its own wake-up after our unschedule, so none is ever orphaned.
            await self.deps.index.unschedule(kind=TimerKind.WAKE, member=session_id)
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
        settings, clock, index = self.deps.settings, self.deps.clock, self.deps.index
        lease = await index.acquire_lease(
            name=lease_name(session_id),
            owner=self.owner,
            ttl=timedelta(seconds=settings.lease.ttl_s),
            now=clock.now(),
        )
        if lease is None:
            return ActivationResult(session_id, Outcome.BUSY), None
        heartbeat = Heartbeat(
            index,
            lease,
            clock=clock,
            period_s=settings.lease.heartbeat_s,
            ttl_s=settings.lease.ttl_s,
        ).start()
        activation: Activation | None = None
        outcome = Outcome.RAN
        # Who brings the session back if this activation does not finish: a released lease
        # needs a retry timer; a lease left alone expires and the reconciler recovers it.
        release = False
        try:
            try:
                snapshot = await self.deps.snapshots.load(session_id)
            except SnapshotNotFound:
                release = True
                return ActivationResult(session_id, Outcome.MISSING), None
            activation = Activation(self.deps, snapshot, heartbeat, self._agent(snapshot))
            await self._drive(activation, reason)
            release = True
        except (CommitConflict, LeaseLost) as exc:
            # Someone else wrote or holds the session. If they finish its work, the retry
            # finds nothing to do; if they vanished, the retry picks it up again.
            outcome = Outcome.CONFLICT if isinstance(exc, CommitConflict) else Outcome.LEASE_LOST
            await self._retry_soon(session_id)
            release = True
        except StopActivation:
            outcome, release = Outcome.STOPPED, True
        except Exception:
            # Storage trouble mid-run: schedule the retry, and only then let the lease go.
            await self._retry_soon(session_id)
            release = True
            raise
        finally:
            # A BaseException (the process is being stopped, the task cancelled) keeps the
            # lease: it expires after the TTL and the reconciler re-activates the session
            # from its last checkpoint, which a released lease would never trigger.
            self.deps.snapshots.release(session_id)
            await heartbeat.stop()
            if release:
                with contextlib.suppress(IndexUnavailable):  # it expires by itself anyway
                    await index.release_lease(heartbeat.lease)
        assert activation is not None
        return self._result(activation, outcome, requested_at), activation.snap

    async def _retry_soon(self, session_id: str) -> None:
        at = self.deps.clock.now() + timedelta(seconds=self.deps.settings.reconciler.interval_s)
        await self.deps.index.schedule(kind=TimerKind.RETRY, member=session_id, at=at)

    def _agent(self, snapshot: SessionSnapshot) -> LoadedAgent | None:
        try:
            return self.plugins.agent(snapshot.agent.name)
        except PluginNotFound:
            return None

    async def _drive(self, act: Activation, reason: Reason) -> None:
        snap = act.snap
        if snap.terminal:
            await act.settle_terminal()
            return
        if act.loaded is None:
            await act.finish(
                SessionState.FAILED,
                reason="agent not found",
                error=ErrorInfo(
                    code="plugin_not_found",
                    message=f"agent {snap.agent.name!r} is not configured on this cluster",
                ),
            )
            return
        if snap.state is SessionState.PENDING:
            ctx = act.agent_context()
            act.update(
                messages=act.loaded.agent.initial_messages(snap.input, ctx),
                variables=ctx.variables,
            )
            act.move(SessionState.RUNNING, reason.value)
            await act.commit()
        if act.snap.state in WAITING_STATES:
            if act.snap.pending_outbox():
                await act.complete_suspend()  # finish what a crashed suspend started
            await act.resume()
        while act.state() is SessionState.RUNNING:
            await act.run()
            state = act.state()
            if state is SessionState.RUNNING:
                return  # the step budget ran out; a retry timer brings the session back
            if state is SessionState.SUSPENDED:
                # Events may have arrived before the wait was even committed (a fast far
                # side, or a client delivery): apply them now rather than sleep on them.
                await act.resume()

    @staticmethod
    def _result(act: Activation, outcome: Outcome, requested_at: float | None) -> ActivationResult:
        latency = None
        first = act.stats.first_step_at
        if requested_at is not None and first is not None:
            latency = max(0.0, first.timestamp() - requested_at)
        return ActivationResult(
            session_id=act.snap.session_id,
            outcome=outcome,
            state=act.snap.state,
            generation=act.snap.generation,
            applied=act.stats.applied,
            observed=act.stats.observed,
            agent_steps=act.stats.agent_steps,
            drifts=act.stats.drifts,
            resume_latency_s=latency,
        )
