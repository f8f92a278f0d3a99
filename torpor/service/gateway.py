"""The webhook gateway: verify, dedupe, route, accept durably, then activate.

For ``POST /v1/hooks/{source}``, in order, on the raw bytes:

1. the source exists and the body is within its size limit;
2. the signature verifies with one of the source's active secrets, and the timestamp is
   within the window in both directions (``torpor.webhooks.signing``);
3. the body parses as CloudEvents (structured, binary or batched) or through the source's
   payload mapping;
4. the signed content (and, for the torpor scheme, the nonce) is claimed in the index
   (``SET NX EX``). A claim that is already held is not yet proof of a replay: its holder
   may have died before storing anything. The durable replay memory decides (a marker per
   accepted request, written last), so a byte-identical retry of a request that stored
   nothing is processed, and a replay of an accepted one is refused with 409 even after
   the index was flushed (``torpor.service.replay``);
5. each event resolves to a wait of the source's tenant, by correlation id or business key,
   through the index or, on a miss, the durable correlation record (a flushed Redis must
   not turn a valid callback away). The event is stamped with the epoch the *sender*
   names, if it names one, so the epoch gate sees an answer to a superseded request for
   what it is; an event that names nothing and could answer a re-planned request is
   ``AmbiguousEvent`` (recorded, not applied);
6. the event is written into the session's inbox (create-only). A redelivery is answered
   200 ``duplicate`` and, if the session has not processed the event yet (the first
   request died before its wake), wakes it;
7. the wake timer is armed, then the request's replay marker is written, the audit record
   being written meanwhile (started after the inbox write, awaited beside the marker);
   the activation is requested once the timer is armed (by a webhook alone in an HTTP
   handler, where it runs behind the answer: before the marker and the record are
   awaited; otherwise after them), and only then the answer goes out: 202 accepted, or
   200 with the ``outcome`` (``stale``, ``late``, ``closed``) when the event cannot
   change the session. (A replica killed between the marker and the audit record leaves
   a marker without its record: the sender's retry is then refused as a replay, 409,
   while the event it carries is stored and will be applied.)

Nothing before step 6 changes any state but the replay claims, which are given back if
the request then fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from torpor import logs, tracing
from torpor.errors import (
    AmbiguousEvent,
    InvalidKey,
    RejectReason,
    SessionNotFound,
    SnapshotCorrupt,
    SourceNotAllowed,
    TorporError,
    UnknownCorrelation,
    WebhookRejected,
)
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.gates import may_restrict
from torpor.models import SessionHeader, Wait, WaitRoute
from torpor.ports import Reason, WaitBinding
from torpor.service.replay import ReplayClaims, ReplayGuard, replay_claims
from torpor.service.sessions import SessionService
from torpor.settings import SourceConfig, verifying_secrets
from torpor.webhooks.capability import open_token
from torpor.webhooks.cloudevents import is_batch, parse_http
from torpor.webhooks.payloads import InboundEvent, loads_json
from torpor.webhooks.rejections import ensure_body_size
from torpor.webhooks.signing import Scheme, Verified, verify

log = logging.getLogger(__name__)

CAPABILITY_SOURCE = "capability"


class Outcome(StrEnum):
    """What one event did, as the sender is told."""

    ACCEPTED = "accepted"  # 202: stored, the session will apply it
    DUPLICATE = "duplicate"  # 200: stored before
    STALE = "stale"  # 200: names an older request (epoch) than the one open: observed only
    LATE = "late"  # 200: after the wait's deadline: observed, the session times out
    CLOSED = "closed"  # 200: the wait it answers is closed already: observed only
    AMBIGUOUS = "ambiguous"  # 409: could answer a re-planned request: recorded, not applied
    UNEXPECTED = "unexpected"  # 403: the wait does not name this source: recorded, not applied
    UNKNOWN = "unknown"  # 404: no wait of this tenant matches

    @property
    def status(self) -> int:
        return {
            Outcome.ACCEPTED: 202,
            Outcome.AMBIGUOUS: 409,
            Outcome.UNEXPECTED: 403,
            Outcome.UNKNOWN: 404,
        }.get(self, 200)


@dataclass(frozen=True)
class Routed:
    event_id: str
    session_id: str | None
    outcome: Outcome
    duplicate: bool = False
    replayed: bool = False  # a duplicate whose exact request was accepted before
    # The session to activate once the request is remembered (its wake timer is armed):
    # asked for last, so the session's own work does not compete with the answer's.
    activate: tuple[str, str | None] | None = None
    # The audit record of a stored event, still being written (beside the replay marker).
    audit: asyncio.Future[Any] | None = None
    # Awaited before the answer: the stored event on disk (``InboxRepository.stage``).
    durable: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class HookResult:
    status: int
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Seen:
    outcome: Outcome
    trace_id: str | None = None
    agent: str | None = None


@dataclass(frozen=True)
class _Resolved:
    binding: WaitBinding | None
    from_record: bool  # the index missed: the wait may be closed (or the index flushed)


class WebhookGateway:
    """Inbound webhooks and capability callbacks, in the order the module describes."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self.audit = sessions.services.audit
        self._handled = sessions.services.observer.webhook_handled
        self.replays = ReplayGuard(sessions.services)
        self._receiving = 0  # webhooks in this gateway between their verify and answer

    # -- shared-secret webhooks --------------------------------------------------------

    def source(self, name: str) -> SourceConfig:
        source = self.services.settings.sources.get(name)
        if source is None:
            raise WebhookRejected(RejectReason.UNKNOWN_SOURCE)
        return source

    async def receive(
        self, source_name: str, body: bytes, headers: Mapping[str, str], *, now: datetime
    ) -> HookResult:
        try:
            # The sender's traceparent continues here; lines logged inside carry the ids.
            with (
                tracing.continued(headers),
                tracing.span("torpor.webhook", **{"torpor.source": source_name}),
                logs.bind(trace_id=_trace_id(headers)),
            ):
                self._receiving += 1
                try:
                    return await self._receive(source_name, body, headers, now)
                finally:
                    self._receiving -= 1
        except WebhookRejected as exc:
            await self._handled(source_name, "rejected", exc.reason.value)
            await self._audit_rejection(source_name, exc.reason, body, headers, now)
            raise
        except Exception as exc:
            await self._failed(source_name, exc)
            raise

    async def _receive(
        self, source_name: str, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> HookResult:
        source = self.source(source_name)
        ensure_body_size(len(body), limit=source.max_body_bytes)
        with tracing.span("torpor.verify", **{"torpor.scheme": source.scheme.value}):
            verified = verify(
                source.scheme,
                body,
                headers,
                verifying_secrets(self.services.settings.sources, source_name),
                now=now,
                tolerance_s=source.tolerance_s,
            )
        events = parse_http(  # pure: a malformed body is refused before anything is claimed
            body,
            headers,
            mapping=source.mapping,
            source_name=source_name,
            now=now,
            max_body_bytes=source.max_body_bytes,
            # Every scheme signs the body (Standard Webhooks also its id and timestamp),
            # never the ce-* headers: binary mode would let an on-path party re-target a
            # captured signed body (another ce-id, correlation id or type). Refused.
            binary=False,
        )
        if source.scheme is Scheme.GITHUB and any(e.correlation_id is None for e in events):
            # GitHub signs no timestamp: a captured delivery verifies forever, and outlives
            # its 24 h replay claim. Addressed by business key it would answer whichever
            # later wait took the key; a correlation id names one wait only.
            raise WebhookRejected(
                RejectReason.MALFORMED_BODY,
                "github-scheme deliveries must name the correlation id (business key alone"
                " is not accepted)",
            )
        claims = replay_claims(source_name, source, verified)
        first = events[0]
        owned = True  # whether the claims are this request's, to give back on failure
        routed: list[Routed] = []
        try:
            # The replay claims and the first event's routing share one index round trip.
            admission = await self.services.index.admit(
                claims=claims.pairs,
                ttl=claims.ttl,
                now=now,
                tenant=source.tenant,
                correlation_id=first.correlation_id,
                business_key=None if first.correlation_id else first.business_key,
            )
            if admission.at is not None:
                # One clock for every replica (the index's): received_at, lateness and the
                # audit record no longer depend on which replica took the request.
                now = admission.at
            # Claims another request holds are not this one's to give back, a refusal's
            # included (a nonce given back would let the next reuse of it through).
            owned = admission.fresh
            if not owned:
                owned = await self.replays.held(claims, now=now)
            crash_point(CrashPoint.GATEWAY_AFTER_CLAIM)
            trace = _trace_id(headers)
            body_sha = hashlib.sha256(body).hexdigest()
            for i, event in enumerate(events):
                # A batch's events in the order sent: the inbox applies what it holds by
                # its time received, and one stamp for all left their order to their keys
                # (a hash): [rejected, approved] for one wait could end approved.
                at = now + timedelta(microseconds=i)
                if i == 0 and admission.fresh:  # the admission resolved it in the index
                    resolved = (
                        _Resolved(admission.binding, from_record=False)
                        if admission.binding
                        else _Resolved(await self._durable(source.tenant, event), True)
                    )
                else:
                    resolved = await self._resolve(source.tenant, event, now)
                routed.append(
                    await self._route(
                        source_name, resolved, event, verified, claims, body_sha, trace, at
                    )
                )
            if any(r.replayed for r in routed):  # woken if need be; still a replay
                await self._audited(routed, remember=None, at=now)
                await self._activate(routed)
                raise WebhookRejected(RejectReason.REPLAYED)
            # A batch of one is answered as a batch: its sender reads ``events``.
            result = await self._answer(routed, batch=is_batch(headers), source=source)
            # A webhook alone in an HTTP handler asks for its activation (which runs
            # behind the answer) before the audit record and the replay marker are
            # awaited: the wake timers are armed already, and the session's load overlaps
            # the flush of the disk (POST -> step p50 0.5-4 ms sooner, README). With others
            # in flight it goes last, as does one awaited in turn: a session that starts
            # then takes the cores the writes need and splits their group commits
            # (resuming under load: 204 -> 157 req/s when every webhook went early).
            early = self.sessions.background and self._receiving == 1
            if early:
                await self._activate(routed)
            # Remembered only by a request that did all of it (a 2xx answer).
            await self._audited(routed, remember=claims if result.status < 300 else None, at=now)
            if not early:
                await self._activate(routed)
            return result
        except BaseException:
            # No audit write outlives its request, whatever failed.
            await asyncio.gather(*(r.audit for r in routed if r.audit), return_exceptions=True)
            # Nothing this request stored is lost by letting a retry through: the inbox
            # dedups it, and a duplicate wakes what was not woken.
            if owned:
                await self.replays.release(claims)
            raise

    async def _audited(
        self, routed: list[Routed], *, remember: ReplayClaims | None, at: datetime
    ) -> None:
        """The stored events' audit records (started in ``_route``) and, for a request
        answered 2xx, its replay marker, awaited together: one wait for durable writes,
        not two. The marker is started only now, after every event is in the inbox with
        its wake timer armed, so it never names an event nothing would wake. Then the
        stored events are made durable (staged in ``_route``). An audit record or an
        event that fails takes back the marker if this request wrote it: the request is
        answered 5xx and its retry must be let through."""
        pending = [r.audit for r in routed if r.audit is not None]
        # A request that stored an event (``activate``): the event names the marker, and
        # retention deletes the two with its session. Any other marker is listed for
        # retention to find on its own (``remember_accepted``).
        in_inbox = any(r.activate is not None for r in routed)
        marker = (
            [self.replays.remember(remember, at=at, in_inbox=in_inbox)]
            if remember is not None
            else []
        )
        results = await asyncio.gather(*pending, *marker, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed:
            # The stored events on disk too: after the audit records, whose flush of the
            # disk covered them in the usual case (then this costs nothing).
            stored = [r.durable() for r in routed if r.durable is not None]
            failed = [
                r
                for r in await asyncio.gather(*stored, return_exceptions=True)
                if isinstance(r, BaseException)
            ]
        if not failed:
            return
        # Only a marker this request created: one found there is another request's, which
        # was answered 2xx (the same bytes sent twice at once, or accepted before).
        if remember is not None and results[-1] is True:
            with contextlib.suppress(Exception):  # the audit failure is what is reported
                await self.replays.forget(remember)
        raise failed[0]

    async def _resolve(self, tenant: str, event: InboundEvent, now: datetime) -> _Resolved:
        index = self.services.index
        found = None
        if event.correlation_id:
            found = await index.resolve(tenant=tenant, now=now, correlation_id=event.correlation_id)
        elif event.business_key:
            found = await index.resolve(tenant=tenant, now=now, business_key=event.business_key)
        if found is not None:
            return _Resolved(found, from_record=False)
        return _Resolved(await self._durable(tenant, event), from_record=True)

    async def _durable(self, tenant: str, event: InboundEvent) -> WaitBinding | None:
        """After an index miss the durable correlation record decides, never the miss: a
        flushed Redis must not turn a valid callback away."""
        records = self.services.correlations
        if event.correlation_id:
            try:
                record = await records.lookup(event.correlation_id)
            except InvalidKey:  # no id torpor issues looks like this: no wait has it
                return None
            return record if record is not None and record.tenant == tenant else None
        if event.business_key:
            return await records.lookup_business_key(tenant=tenant, business_key=event.business_key)
        return None

    async def _classify(
        self, source_name: str, resolved: _Resolved, event: InboundEvent, now: datetime
    ) -> _Seen:
        """What the event can do to its wait, as far as the edge can tell; the trace id of
        the session it names (for the audit record: the webhook links to the reasoning it
        caused) and its agent (the activation is routed without another read)."""
        binding = resolved.binding
        if binding is None:
            return _Seen(Outcome.UNKNOWN)
        try:
            return await self._classify_bound(source_name, resolved, binding, event, now)
        except SessionNotFound:
            # Bound to a session that is gone (retention, behind a stale record): the
            # event's own outcome, not the request's, so a batch's other events stand.
            return _Seen(Outcome.UNKNOWN)

    async def _classify_bound(
        self,
        source_name: str,
        resolved: _Resolved,
        binding: WaitBinding,
        event: InboundEvent,
        now: datetime,
    ) -> _Seen:
        # The index binds no sources: the snapshot's header says who may answer (a short
        # read, no decompression); a header older than 0.4 sends us to the whole snapshot.
        header = await self._header(binding)
        if header is not None and header.waits is not None:
            route = header.route_for(binding.correlation_id)
            outcome = self._verdict(source_name, resolved, event, now, route, header.state.terminal)
            return _Seen(outcome, header.trace_id, header.agent)
        snapshot = await self.sessions.get(binding.session_id, tenant=binding.tenant)
        wait = snapshot.wait_for(binding.correlation_id)
        outcome = self._verdict(source_name, resolved, event, now, wait, snapshot.terminal)
        return _Seen(outcome, snapshot.trace_id, snapshot.agent.name)

    async def _header(self, binding: WaitBinding) -> SessionHeader | None:
        """The session's header, or None where only the whole snapshot will do: another
        tenant's session (reported as not found there) or a damaged header (quarantine
        decides there)."""
        try:
            header = await self.services.snapshots.header(binding.session_id)
        except (SnapshotCorrupt, InvalidKey):
            return None
        return header if header.tenant == binding.tenant else None

    @staticmethod
    def _verdict(
        source_name: str,
        resolved: _Resolved,
        event: InboundEvent,
        now: datetime,
        wait: Wait | WaitRoute | None,
        terminal: bool,
    ) -> Outcome:
        binding = resolved.binding
        assert binding is not None
        if wait is not None and may_restrict(wait) and source_name not in wait.allowed_sources:
            # Knowing the correlation id or business key is not enough: only the sources
            # the wait names may answer it (the gate observes anything else as UNEXPECTED).
            return Outcome.UNEXPECTED
        key_only = event.epoch is None and event.correlation_id is None
        replanned = wait is not None and wait.replanned
        if key_only and (binding.epoch > 1 or replanned):
            # Found by business key alone, and the session has waited before (in an earlier
            # epoch, or in this one: a fan-in member's request reissued in place). If an
            # earlier wait used the same key (a re-plan), the key now names the new wait
            # and a late answer to the superseded request would be applied to it: only the
            # sender can say which it answers (for a request reissued in place, only by
            # the correlation id: an echoed epoch names both).
            if wait is None:
                return Outcome.CLOSED
            if wait.replanned:
                return Outcome.AMBIGUOUS
        if event.epoch is not None and event.epoch != binding.epoch:
            return Outcome.STALE
        # From the record alone, the index no longer binds it: closed, or the index lost.
        if resolved.from_record and (terminal or wait is None):
            return Outcome.CLOSED
        if now > binding.deadline:
            return Outcome.LATE
        return Outcome.ACCEPTED

    async def _route(
        self,
        source_name: str,
        resolved: _Resolved,
        event: InboundEvent,
        verified: Verified,
        claims: ReplayClaims,
        body_sha: str,
        trace: str | None,
        now: datetime,
    ) -> Routed:
        audit: dict[str, Any] = {
            "source": source_name,
            "at": now,
            "event_id": event.event_id,
            "correlation_id": event.correlation_id,
            "body_sha256": body_sha,
            "signature": verified.signature[:512],
            "timestamp": verified.timestamp,
            "trace_id": trace,
        }
        seen = await self._classify(source_name, resolved, event, now)
        outcome, audit["session_trace_id"] = seen.outcome, seen.trace_id
        binding = resolved.binding
        if binding is None or outcome in (Outcome.UNKNOWN, Outcome.AMBIGUOUS, Outcome.UNEXPECTED):
            # Unknown, another tenant's, ambiguous, or from a source the wait does not
            # name: nothing stored, and on the record.
            sid = binding.session_id if binding else None
            await self.audit.append(verdict=outcome.value, session_id=sid, **audit)
            await self._handled(source_name, outcome.value)
            return Routed(event.event_id, sid, outcome)
        data: Any = event.data
        if event.status is not None and isinstance(data, dict) and "status" not in data:
            data = {**data, "status": event.status}
        addressed = event.epoch is None or event.epoch == binding.epoch
        logs.update(session_id=binding.session_id, correlation_id=binding.correlation_id)
        inbox_span = tracing.span(
            "torpor.inbox.write",
            **{"torpor.session_id": binding.session_id, "torpor.event_id": event.event_id},
        )
        stored = InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=binding.session_id,
            source=source_name,
            event_id=event.event_id,
            type=event.type,
            received_at=now,
            # A CloudEvent's id is its producer's (its own ``source``); a mapped payload's
            # is the torpor source's, which is all its ``source`` names.
            producer=None if event.source == f"torpor:{source_name}" else event.source,
            correlation_id=binding.correlation_id,
            business_key=event.business_key,
            # The sender's own word on which request it answers wins over the wait the
            # index resolved now: that is what lets the epoch gate see a stale answer.
            epoch=binding.epoch if event.epoch is None else event.epoch,
            step_id=binding.step_id if addressed else None,
            data=data,
            trace_id=trace,
            verified_by=verified.scheme.value,
            content_digest=verified.content_digest,
        )
        with inbox_span:
            # Staged: visible now, durable by the answer (``_audited``), with the audit
            # record's flush in the usual case: one wait for the disk, not two in a row.
            written_in = await self.services.inbox.stage(stored)
            crash_point(CrashPoint.GATEWAY_AFTER_INBOX)
        new = written_in.new
        verdict = outcome.value if new else Outcome.DUPLICATE.value
        audit["correlation_id"] = binding.correlation_id
        await self._handled(source_name, verdict)
        record = self.audit.append(verdict=verdict, session_id=binding.session_id, **audit)
        if new:
            # The audit record is written while the wake timer is armed and then beside
            # the replay marker (``_receive``). The timer strictly after the inbox write:
            # an activation unschedules it before its last look at the inbox, and an
            # event that lands after that look must find a timer of its own. The marker
            # strictly after the timer: a marker answers the sender's retry with 409, so
            # it must never name an event nothing would wake.
            written = asyncio.ensure_future(record)
            try:
                await self.sessions.arm_wake(binding.session_id)
            except BaseException:
                await asyncio.gather(written, return_exceptions=True)
                raise
            crash_point(CrashPoint.GATEWAY_AFTER_WAKE)
            return Routed(
                event.event_id,
                binding.session_id,
                outcome,
                activate=(binding.session_id, seen.agent),
                audit=written,
                durable=written_in.durable,
            )
        await asyncio.gather(record, self._wake_if_pending(binding.session_id, stored.key))
        replayed = await self.replays.was_accepted(claims)
        return Routed(event.event_id, binding.session_id, Outcome.DUPLICATE, True, replayed)

    async def _activate(self, routed: list[Routed]) -> None:
        """Ask for the stored events' activations (their wake timers are armed)."""
        for r in routed:
            if r.activate is not None:
                session_id, agent = r.activate
                await self.sessions.activate(session_id, reason=Reason.EVENT, agent=agent)

    async def _wake(self, session_id: str) -> None:
        await self.sessions.activate_for_event(session_id)  # the wake timer, then a request
        crash_point(CrashPoint.GATEWAY_AFTER_WAKE)

    async def _wake_if_pending(self, session_id: str, key: str) -> None:
        """A redelivered event the session has not processed yet: its first delivery may
        have died between the inbox write and the wake timer, so arm it (again)."""
        try:  # its processed ids only: the whole session is all its history
            processed = await self.services.snapshots.processed_events(session_id)
        except SnapshotCorrupt:
            # Set aside, or about to be: the event is stored all the same, and an
            # activation is what quarantines the session (again) or, once an operator
            # restored it, takes the event. The sender is answered "duplicate", not a 500
            # at every retry of an event it already delivered.
            await self._wake(session_id)
            return
        if key not in processed:
            await self._wake(session_id)

    async def _answer(
        self, routed: list[Routed], *, batch: bool, source: SourceConfig
    ) -> HookResult:
        body: dict[str, Any]
        if batch:
            body = {
                "events": [
                    {
                        "event_id": r.event_id,
                        "status": r.outcome.status,
                        "duplicate": r.duplicate,
                        "outcome": r.outcome.value,
                    }
                    for r in routed
                ]
            }
            accepted = any(r.outcome is Outcome.ACCEPTED for r in routed)
            return HookResult(202 if accepted else 200, body)
        [one] = routed
        if one.outcome is Outcome.UNKNOWN:
            raise UnknownCorrelation("no open wait matches this event")
        if one.outcome is Outcome.UNEXPECTED:
            raise SourceNotAllowed("this source may not answer the wait the event names")
        if one.outcome is Outcome.AMBIGUOUS:
            raise AmbiguousEvent(
                "this event names its request only by business key, and that request was"
                " re-planned: echo the correlation id (or the epoch, or the idempotency key"
                " the request was sent with) so it can be matched"
            )
        body = {"event_id": one.event_id, "duplicate": one.duplicate, "outcome": one.outcome}
        if one.outcome is not Outcome.ACCEPTED and one.session_id:
            body["session"] = await self.outcome(one.session_id, source)
        return HookResult(one.outcome.status, body)

    async def outcome(self, session_id: str, source: SourceConfig) -> dict[str, Any]:
        """What a late or duplicate sender is told: the session's state, and its result
        only to a source configured to receive it (the result is the submitter's, and a
        sender answering one wait need not learn it)."""
        snapshot = await self.sessions.get(session_id, tenant=source.tenant)
        told: dict[str, Any] = {"state": snapshot.state.value}
        if source.receives_result:
            told["result"] = snapshot.result
        return told

    # -- capability callbacks --------------------------------------------------------

    async def capability(
        self, token: str, body: bytes, headers: Mapping[str, str], *, now: datetime
    ) -> HookResult:
        try:
            return await self._capability(token, body, headers, now)
        except WebhookRejected as exc:
            await self._handled(CAPABILITY_SOURCE, "rejected", exc.reason.value)
            if exc.reason is not RejectReason.TOKEN_USED:  # that one is on the record already
                await self._audit_rejection(CAPABILITY_SOURCE, exc.reason, body, headers, now)
            raise
        except Exception as exc:
            await self._failed(CAPABILITY_SOURCE, exc)
            raise

    async def _failed(self, source: str, exc: Exception) -> None:
        """A webhook the edge answers 5xx (storage down, a bug) is counted as ``error``,
        so an alert sees senders being turned away; 4xx answers are counted where raised."""
        status = exc.status if isinstance(exc, TorporError) else 500
        if status >= 500:
            with contextlib.suppress(Exception):  # the original error is what the caller gets
                await self._handled(source, "error", type(exc).__name__)

    async def refused_unread(
        self, source: str, reason: RejectReason, headers: Mapping[str, str], *, now: datetime
    ) -> None:
        """A request the edge refused before it had read the whole body (too large while
        streaming it, or a capability link whose token is refused before its body is
        read): observed and audited like any rejection, with an empty body digest, since
        the body was never read in full."""
        await self._handled(source, "rejected", reason.value)
        await self._audit_rejection(source, reason, None, headers, now)

    async def _audit_rejection(
        self,
        source: str,
        reason: RejectReason,
        body: bytes | None,
        headers: Mapping[str, str],
        now: datetime,
    ) -> None:
        """A refused request on the record: who, why and the body's digest, never the body
        (nor a capability token); no digest (empty) for a body that was not read in full.
        A failing audit store must not turn a 4xx into a 500: the failure shows on the
        health route (``audit.healthy``) instead."""
        try:
            await self.audit.append(
                verdict=f"rejected:{reason.value}",
                at=now,
                source=source[:128],  # the sender names it: bounded
                body_sha256="" if body is None else hashlib.sha256(body).hexdigest(),
                trace_id=_trace_id(headers),
            )
        except Exception:
            log.warning("audit of a rejected %s request failed", source[:128], exc_info=True)

    async def _capability(
        self, token: str, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> HookResult:
        settings = self.services.settings
        keys = settings.capability_key_bytes()
        if not keys:
            raise WebhookRejected(RejectReason.INVALID_TOKEN)
        ensure_body_size(len(body), limit=settings.security.max_request_bytes)
        claims = open_token(token, keys=keys, now=now)
        content_type = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise WebhookRejected(RejectReason.UNSUPPORTED_MEDIA_TYPE)
        data = loads_json(body)
        digest = hashlib.sha256(body).hexdigest()
        event = InboxEvent.new(
            kind=EventKind.CALLBACK,
            session_id=claims.session_id,
            source=CAPABILITY_SOURCE,
            event_id=claims.token_id,
            type="torpor.capability.callback",
            received_at=now,
            correlation_id=claims.correlation_id,
            epoch=claims.epoch,
            data=data,
            trace_id=_trace_id(headers),
            verified_by="capability",
            content_digest=digest,
        )
        new = await self.services.inbox.deliver(event)
        crash_point(CrashPoint.GATEWAY_AFTER_INBOX)
        # The inbox object is the durable proof the token was used. The same answer again
        # is the sender retrying (its first request may have died before the wake): it is
        # settled, not refused; only a different answer through a used link is.
        retried = False
        if not new:
            stored = await self.services.inbox.find(claims.session_id, event.key)
            retried = stored is not None and stored.content_digest == digest
            await self._wake_if_pending(claims.session_id, event.key)
        else:
            await self._wake(claims.session_id)
        await self.audit.append(
            verdict="accepted" if new else "duplicate" if retried else "rejected:token_used",
            at=now,
            source=CAPABILITY_SOURCE,
            event_id=claims.token_id,
            session_id=claims.session_id,
            correlation_id=claims.correlation_id,
            body_sha256=digest,
            trace_id=_trace_id(headers),
        )
        if not new and not retried:
            raise WebhookRejected(RejectReason.TOKEN_USED)
        await self._handled(CAPABILITY_SOURCE, "accepted" if new else "duplicate")
        return HookResult(202 if new else 200, {"event_id": claims.token_id, "duplicate": not new})


def _trace_id(headers: Mapping[str, str]) -> str | None:
    """The trace id of a W3C ``traceparent`` header, if the sender sent one."""
    lowered = {k.lower(): v for k, v in headers.items()}
    parts = lowered.get("traceparent", "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and all(c in "0123456789abcdef" for c in parts[1]):
        return parts[1]
    return None
