"""The session service: submit, inspect, wait for, cancel, deliver events.

One implementation serves the Python client, the HTTP task API and the CLI. It writes
durable state first (snapshot, inbox event) and only then asks for an activation, so a
lost activation request delays work but never loses it: the activation timer scheduled
alongside brings the reconciler round. Batches are in ``torpor.service.batches``, the
background coalescing of activation requests in ``torpor.service.coalescing``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import JsonValue

from torpor import tracing
from torpor.approval.tool import REASSIGN
from torpor.backoff import Backoff
from torpor.errors import (
    ConfigError,
    IdempotencyInProgress,
    IdempotencyMismatch,
    InvalidKey,
    InvalidRequest,
    ObjectExists,
    PluginNotFound,
    ReassignmentRefused,
    SessionNotFound,
    SnapshotCorrupt,
    UnknownAgent,
    UnknownCorrelation,
)
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ids import checked_tenant, new_session_id, new_trace_id, session_id_ms
from torpor.models import AgentRef, OutboxEntry, SessionSnapshot
from torpor.plugins import LoadedAgent
from torpor.ports import (
    Activator,
    IdempotencyRecord,
    IdempotencyStatus,
    Reason,
    SubmitKey,
    TimerKind,
)
from torpor.ports.services import Services
from torpor.service import quarantine
from torpor.service.admission import AdmittingActivator
from torpor.service.coalescing import Coalescer, Fallback, request_activation
from torpor.session import dead_letters
from torpor.ssrf import check_callback
from torpor.tools import LongRunningTool
from torpor.work import Progress

IDEMPOTENCY_TTL = timedelta(hours=24)
# How long a claim's request has to create the session it names before a retry of the
# same request takes the claim over (creating that session itself).
SUBMIT_CLAIM_GRACE = timedelta(seconds=10)
# Polling for the end: often at first, then once a second.
WAIT_POLL = Backoff(base_s=0.05, cap_s=1.0, factor=1.5, jitter=0)


@dataclass(frozen=True)
class Submitted:
    session_id: str
    created: bool  # False: an earlier request with the same Idempotency-Key made it


def fingerprint(payload: dict[str, Any]) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class SessionService:
    """Submit, inspect, wait for, cancel and deliver events to sessions of any tenant.

    ``background=True`` (an HTTP handler, the reconciler) lets activation requests run
    behind the caller, coalesced per session; otherwise each is awaited in turn.
    """

    def __init__(
        self, services: Services, activator: Activator, *, background: bool = False
    ) -> None:
        self.services = services
        # Batch sessions take a running slot before they are activated (batches' caps).
        self.activator = activator = AdmittingActivator.around(activator, services)
        # In an HTTP handler, answer first and let the activation request run behind.
        self.background = background
        self._coalescer = Coalescer(
            activator,
            max_inflight=services.settings.max_inflight_activations,
            fallback=Fallback.of(services),
        )

    @property
    def _now(self) -> datetime:
        return self.services.clock.now()

    async def _activation_timer(self, session_id: str) -> None:
        """The safety net under every activation request: if no activation confirms the
        session's inbox within the grace period, the reconciler activates it."""
        grace = timedelta(seconds=self.services.settings.reconciler.wake_grace_s)
        await self.services.index.schedule(
            kind=TimerKind.WAKE, member=session_id, at=self._now + grace
        )

    # -- submit ---------------------------------------------------------------------

    async def submit(
        self,
        *,
        tenant: str,
        agent: str,
        input: JsonValue,
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        idempotency_key: str | None = None,
        batch_id: str | None = None,
        session_id: str | None = None,
        agent_checked: bool = False,
    ) -> Submitted:
        """Create a session and ask for its activation.

        ``session_id``: a caller-chosen id (a batch's document, ``batch_session_id``), for
        a caller that validated the request itself: creating it again finds it and only
        finishes what the first try may not have (index, timer, activation).

        ``agent_checked``: the agent was configured when the request was accepted (a
        batch's fan-out, behind its 202). One removed since is no refusal then: the
        session is made, and its activation ends it FAILED (``plugin_not_found``) as it
        ends any session whose agent went; refused, the fan-out retried it for ever."""
        if session_id is None:
            # A caller's own request (the API's tenants, a client's, checked there too); a
            # batch's fan-out was checked when its batch was accepted.
            checked_tenant(tenant)
        try:
            loaded: LoadedAgent | None = self.services.plugins.agent(agent)
        except PluginNotFound as exc:
            if not agent_checked:
                raise UnknownAgent(f"no agent named {agent!r} is configured") from exc
            loaded = None
        metadata = dict(metadata or {})
        if callback_url is not None and session_id is None:
            if self.services.settings.notifications.key is None:
                raise InvalidRequest("callback_url needs notifications set up (notify_key)")
            notifications = self.services.settings.notifications
            await check_callback(
                callback_url,
                allow_private=notifications.allow_private_callbacks,
                timeout_s=notifications.timeout_s,
            )
        now = self._now
        chosen = session_id is not None
        session_id = session_id or new_session_id(int(now.timestamp() * 1000))
        if idempotency_key is not None:
            fp = fingerprint(
                {"agent": agent, "input": input, "metadata": metadata, "callback": callback_url}
            )
            claim = await self.services.index.claim_idempotency(
                tenant=tenant,
                key=idempotency_key,
                fingerprint=fp,
                session_id=session_id,
                ttl=IDEMPOTENCY_TTL,
                now=now,
            )
            if claim.created:
                claim = await self._durable_claim(tenant, idempotency_key, claim, now)
            if not claim.created:
                if claim.status is IdempotencyStatus.DONE and claim.fingerprint == fp:
                    return Submitted(claim.session_id, created=False)
                # In progress, or its request died: the claim names the session it creates.
                session_id = claim.session_id
                answer = await self._retried(
                    session_id, claim.fingerprint, fp, idempotency_key, agent
                )
                if answer is not None:
                    return answer
                # Take the claim over by creating the very session it names: creation is
                # create-only, so if the first request is alive after all, one of us wins.
                # Its durable record first: the first request may have died before it.
                held = await self.services.submit_keys.claim(
                    tenant=tenant,
                    key=idempotency_key,
                    record=SubmitKey(session_id=session_id, fingerprint=fp, created_at=now),
                    ttl=IDEMPOTENCY_TTL,
                )
                if held.session_id != session_id:
                    # The index and the store disagree (the index was lost between the
                    # request and this retry): the durable record is the key's.
                    session_id = held.session_id
                    answer = await self._retried(
                        session_id, held.fingerprint, fp, idempotency_key, agent
                    )
                    if answer is not None:
                        return answer
        crash_point(CrashPoint.SUBMIT_AFTER_CLAIM)
        snapshot = SessionSnapshot(
            session_id=session_id,
            tenant=tenant,
            agent=AgentRef(name=agent, version=loaded.agent.version if loaded else ""),
            # the caller's trace when it sent a traceparent, else a trace of its own
            trace_id=tracing.trace_id() or new_trace_id(),
            input=input,
            metadata=metadata,
            callback_url=callback_url,
            batch_id=batch_id,
            variables={"tool_versions": dict(loaded.tools.versions()) if loaded else {}},
            retry={"max_attempts": loaded.config.max_tool_retries} if loaded else {},
            created_at=now,
            updated_at=now,
        )
        # The claim is never released from here on: once ``create`` may have run, a retry
        # must find this session (``_created``), not make a second one.
        try:
            snapshot = await self.services.snapshots.create(snapshot)
        except ObjectExists:
            if idempotency_key is None and not chosen:
                raise  # a fresh id taken: fail loudly rather than merge two sessions
            existing = await self._created(session_id)
            if existing is None:
                raise
            await self._finish_submit(existing, idempotency_key, agent)
            return Submitted(session_id, created=False)
        crash_point(CrashPoint.SUBMIT_AFTER_CREATE)
        await self._finish_submit(snapshot, idempotency_key, agent)
        return Submitted(session_id, created=True)

    async def _retried(
        self, session_id: str, claimed: str, fp: str, key: str, agent: str
    ) -> Submitted | None:
        """A retry of the request the key names ``session_id`` for (``claimed``: that
        request's fingerprint): answered with the session if it exists; None when its
        request died before making it and this one may take over and make it."""
        if claimed != fp:
            raise IdempotencyMismatch(
                "this Idempotency-Key was already used with a different request"
            )
        existing = await self._created(session_id)
        if existing is not None:
            await self._finish_submit(existing, key, agent)
            return Submitted(session_id, created=False)
        if not self._claim_stale(session_id, self._now):
            raise IdempotencyInProgress(
                "the first request with this Idempotency-Key is still being processed"
            )
        return None

    async def _durable_claim(
        self, tenant: str, key: str, claim: IdempotencyRecord, now: datetime
    ) -> IdempotencyRecord:
        """The index's fresh claim, checked against the key's durable record: a retry
        after the index was lost finds there the session the key made, where the index
        alone would let it make a second one. The durable record is written before the
        session is created, so the two cannot disagree about a session that exists."""
        record = SubmitKey(
            session_id=claim.session_id, fingerprint=claim.fingerprint, created_at=now
        )
        held = await self.services.submit_keys.claim(
            tenant=tenant, key=key, record=record, ttl=IDEMPOTENCY_TTL
        )
        if held == record:
            return claim
        # The index's claim names the session this request would have made: point it
        # at the one the key made, then go on as a retry the index had remembered.
        index = self.services.index
        await index.release_idempotency(tenant=tenant, key=key)
        await index.claim_idempotency(
            tenant=tenant,
            key=key,
            fingerprint=held.fingerprint,
            session_id=held.session_id,
            ttl=IDEMPOTENCY_TTL,
            now=now,
        )
        return IdempotencyRecord(
            key, held.session_id, held.fingerprint, IdempotencyStatus.IN_PROGRESS, created=False
        )

    def _claim_stale(self, session_id: str, now: datetime) -> bool:
        """Whether a claim's request has had time to create its session and did not."""
        claimed_ms = session_id_ms(session_id)
        if claimed_ms is None:  # not an id submit made: its age is unknown, leave it be
            return False
        claimed_at = datetime.fromtimestamp(claimed_ms / 1000, tz=now.tzinfo)
        return now - claimed_at >= SUBMIT_CLAIM_GRACE

    async def _created(self, session_id: str) -> SessionSnapshot | None:
        try:  # its state and generation only (``get``)
            return await self.services.snapshots.load_stored(session_id)
        except SessionNotFound:
            return None

    async def _finish_submit(
        self, snapshot: SessionSnapshot, idempotency_key: str | None, agent: str
    ) -> None:
        """Everything after the snapshot exists; idempotent, so a retry may run it again."""
        index, tenant, session_id = self.services.index, snapshot.tenant, snapshot.session_id
        await index.record_session(
            tenant=tenant,
            session_id=session_id,
            state=snapshot.state,
            generation=snapshot.generation,
        )
        await self._activation_timer(session_id)
        if idempotency_key is not None:
            await index.finish_idempotency(
                tenant=tenant, key=idempotency_key, ttl=IDEMPOTENCY_TTL, now=self._now
            )
        await self.activate(session_id, reason=Reason.SUBMIT, agent=agent)

    # -- inspect ----------------------------------------------------------------------

    async def get(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """A tenant never sees another tenant's session: it is simply not found.

        The snapshot as stored, a long session's sealed history left out: what is shown,
        waited on and streamed is its state, waits, result and transitions, and reading
        its chunks made every GET, poll and streamed change of a session 1,000 steps old
        58 more reads (a lost chunk is found by the activation that loads it whole)."""
        try:
            snapshot = await self.services.snapshots.load_stored(session_id)
        except InvalidKey:  # not a session id at all: as not found as any other
            raise SessionNotFound(f"no session {session_id[:80]!r}") from None
        except SnapshotCorrupt as exc:
            snapshot = await quarantine.stand_in(self.services, session_id, exc)
        if tenant is not None and snapshot.tenant != tenant:
            raise SessionNotFound(f"no session {session_id}")
        return snapshot

    async def wait(
        self, session_id: str, *, timeout_s: float = 300.0, tenant: str | None = None
    ) -> SessionSnapshot:
        """Poll until the session ends; raise TimeoutError with the last state otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        attempt = 0
        while True:
            snapshot = await self.get(session_id, tenant=tenant)
            if snapshot.terminal:
                return snapshot
            if loop.time() >= deadline:
                raise TimeoutError(f"session {session_id} still {snapshot.state}")
            await asyncio.sleep(WAIT_POLL.delay_s(attempt))
            attempt += 1

    async def progress(self, session_id: str) -> list[Progress]:
        """What the session's running work last reported (kept outside the snapshot)."""
        if self.services.progress is None:
            return []
        return await self.services.progress.of(session_id)

    # -- change ---------------------------------------------------------------------

    async def cancel(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """Idempotent: the cancel request is one inbox event, whoever sends it how often."""
        snapshot = await self.get(session_id, tenant=tenant)
        if not snapshot.terminal:
            await self.deliver(
                InboxEvent.new(
                    kind=EventKind.CANCEL,
                    session_id=session_id,
                    source="torpor",
                    event_id="cancel",
                    type="torpor.session.cancel",
                    received_at=self._now,
                )
            )
        return snapshot

    async def resend_outbox(
        self, session_id: str, entry_id: str, *, tenant: str | None = None
    ) -> OutboxEntry:
        """An operator's resend of a dead letter (a compensation or notice that gave up):
        back to PENDING under the session's lease, a retry timer as safety net, then an
        activation sends it under its unchanged idempotency key."""
        await self.get(session_id, tenant=tenant)  # a tenant resends only its own
        entry = await dead_letters.resend(
            self.services, session_id, entry_id, owner=f"operator:{new_trace_id()}"
        )
        await self.services.index.schedule(kind=TimerKind.RETRY, member=session_id, at=self._now)
        await self.activate(session_id, reason=Reason.RETRY)
        return entry

    async def reassign_approval(
        self,
        session_id: str,
        correlation_id: str,
        *,
        approvers: list[str],
        by: str,
        why: str = "",
        tenant: str | None = None,
    ) -> str:
        """Operator action: give an open approval to other approvers. An instruction in the
        session's inbox (who and why on the record), which the approval tool turns into a
        new request in a new epoch under the session's lease, withdrawing the old one.
        Returns the instruction's event id."""
        snapshot = await self.get(session_id, tenant=tenant)
        wait = snapshot.wait_for(correlation_id)
        if wait is None or snapshot.terminal:
            raise UnknownCorrelation("the session has no such open wait")
        if not approvers or not all(isinstance(a, str) and 0 < len(a) <= 256 for a in approvers):
            raise InvalidRequest("approvers: one or more names of at most 256 characters")
        # Asked here too, so that the operator hears a refusal (before, a 202 and only an
        # alert later); the session's tool decides again under the lease, with the wait
        # as it is then. An agent not configured here, or that does not load here, is
        # left to the session.
        try:
            tool = self.services.plugins.agent(snapshot.agent.name).tools.get(wait.tool_name)
        except (PluginNotFound, ConfigError):
            tool = None
        if isinstance(tool, LongRunningTool):
            refused = tool.reassignment_refused(wait, list(approvers))
            if refused:
                raise ReassignmentRefused(refused)
        event_id = f"reassign:{new_trace_id()}"
        await self.deliver(
            InboxEvent.answering(
                wait,
                kind=EventKind.OPERATOR,
                session_id=session_id,
                source="torpor",  # reserved: no webhook source can write under it
                event_id=event_id,
                type=REASSIGN,
                received_at=self._now,
                data={"approvers": list(approvers), "by": by[:256], "why": why[:1000]},
            )
        )
        return event_id

    async def retry(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot:
        """Operator action: take a QUARANTINED session back (``torpor.service.quarantine``)."""
        return await quarantine.retry(self, session_id, tenant=tenant)

    async def deliver(self, event: InboxEvent) -> bool:
        """Durably accept an event for a session, then activate it. False for a redelivery."""
        new = await self.services.inbox.deliver(event)
        if new:
            await self.activate_for_event(event.session_id, reason=_reason_for(event))
        return new

    async def arm_wake(self, session_id: str) -> None:
        """The safety net alone, for a caller that asks for the activation later."""
        await self._activation_timer(session_id)

    async def activate_for_event(self, session_id: str, *, reason: Reason = Reason.EVENT) -> None:
        """After a durable inbox write: a timer as safety net, then an activation."""
        await self._activation_timer(session_id)
        await self.activate(session_id, reason=reason)

    async def activate(self, session_id: str, *, reason: Reason, agent: str | None = None) -> None:
        """Ask for an activation. Failure here loses nothing: the state is already durable
        and the activation timer brings the reconciler round."""
        if self.background:
            self._coalescer.request(session_id, reason, agent)
        else:
            await request_activation(self.activator, session_id, reason, agent)

    async def drain(self) -> None:
        """Wait for background activation requests (tests, orderly shutdown)."""
        await self._coalescer.drain()


def _reason_for(event: InboxEvent) -> Reason:
    # A cancel is activated as one: it is never held back behind a batch's running cap.
    return Reason.CANCEL if event.kind is EventKind.CANCEL else Reason.EVENT
