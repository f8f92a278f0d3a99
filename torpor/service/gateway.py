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
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from torpor import logs, tracing
from torpor.awaiting import settled
from torpor.errors import (
    AmbiguousEvent,
    RejectReason,
    SessionNotFound,
    SourceNotAllowed,
    TorporError,
    UnknownCorrelation,
    WebhookRejected,
)
from torpor.faults import CrashPoint, crash_point
from torpor.service.gateway_capability import CAPABILITY_SOURCE, GatewayCapability
from torpor.service.gateway_edge import _trace_id, own_call_cancelled
from torpor.service.gateway_outcomes import HookResult, Outcome, Routed, _Resolved
from torpor.service.replay import ReplayClaims, replay_claims
from torpor.settings import SourceConfig, verifying_secrets
from torpor.webhooks.cloudevents import is_batch, parse_http
from torpor.webhooks.headers import RequestHeaders
from torpor.webhooks.rejections import ensure_body_size
from torpor.webhooks.signing import Scheme, verify

# Imported from here by the rest of torpor, its tests and benches (the parts live in
# ``torpor.service.gateway_*``; a test patching one of them patches the module that
# reads it).
__all__ = [
    "CAPABILITY_SOURCE",
    "HookResult",
    "Outcome",
    "Routed",
    "WebhookGateway",
]


class WebhookGateway(GatewayCapability):
    """Inbound webhooks and capability callbacks, in the order the module describes."""

    # -- shared-secret webhooks --------------------------------------------------------

    async def receive(
        self, source_name: str, body: bytes, headers: Mapping[str, str], *, now: datetime
    ) -> HookResult:
        task = asyncio.current_task()
        try:
            # Read once, for the verifier, the parser and the trace alike.
            read = RequestHeaders.of(headers)
            # The sender's traceparent continues here; lines logged inside carry the ids.
            carried = read.only(tracing.TRACE_HEADERS)
            trace = _trace_id(carried)
            with (
                tracing.continued(carried),
                tracing.span("torpor.webhook", **{"torpor.source": source_name}),
                logs.bind(trace_id=trace),
            ):
                self._receiving += 1
                try:
                    return await self._receive(source_name, body, read, now, trace)
                finally:
                    self._receiving -= 1
        except WebhookRejected as exc:
            await self._handled(source_name, "rejected", exc.reason.value)
            await self._audit_rejection(source_name, exc.reason, body, headers, now)
            raise
        except asyncio.CancelledError as exc:
            if not own_call_cancelled(task):
                raise
            raise await self._call_cancelled(source_name) from exc
        except Exception as exc:
            await self._failed(source_name, exc)
            raise

    async def _receive(
        self,
        source_name: str,
        body: bytes,
        headers: RequestHeaders,
        now: datetime,
        trace: str | None,
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
                raise WebhookRejected(RejectReason.REPLAYED)  # counted as that alone
            # A batch of one is answered as a batch: its sender reads ``events``.
            try:
                result = await self._answer(routed, batch=is_batch(headers), source=source)
            except TorporError as exc:
                # The event alone names no wait it may answer (404, 403, 409): stored
                # nothing, counted as what it was, once.
                if exc.status < 500:
                    await self._counted(source_name, routed)
                raise
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
            await self._counted(source_name, routed)  # what it stored is on disk now
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

    async def _counted(self, source_name: str, routed: list[Routed]) -> None:
        """Each event's outcome, counted once the request's writes are done: an event the
        inbox took whose audit record then failed is the request's ``error`` alone, not an
        ``accepted`` too, and a replay is its ``rejected`` alone."""
        for r in routed:
            await self._handled(source_name, r.outcome.value)

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
        results = await settled(*pending, *marker)
        failed = [r for r in results if isinstance(r, BaseException)]
        if not failed:
            # The stored events on disk too: after the audit records, whose flush of the
            # disk covered them in the usual case (then this costs nothing).
            stored = [r.durable() for r in routed if r.durable is not None]
            failed = [r for r in await settled(*stored) if isinstance(r, BaseException)]
        if not failed:
            return
        # Only a marker this request created: one found there is another request's, which
        # was answered 2xx (the same bytes sent twice at once, or accepted before).
        if remember is not None and results[-1] is True:
            with contextlib.suppress(Exception):  # the audit failure is what is reported
                await self.replays.forget(remember)
        raise failed[0]

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
            # A session removed since its event was routed (retention) has no state to
            # tell: the event's own outcome stands, not a 404 for a request that stored.
            with contextlib.suppress(SessionNotFound):
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
