"""The webhook gateway: verify, dedupe, route, accept durably, then activate.

For ``POST /v1/hooks/{source}``, in order, on the raw bytes:

1. the source exists and the body is within its size limit;
2. the signature verifies with one of the source's active secrets, and the timestamp is
   within the window in both directions (``torpor.webhooks.signing``);
3. the exact signed content has not been seen before (``SET NX EX``), nor, for the torpor
   scheme, the nonce: a replay is refused with 409 before anything is written;
4. the body parses as CloudEvents (structured, binary or batched) or through the source's
   payload mapping;
5. each event resolves to a wait of the source's tenant, by correlation id or business key,
   through the index or, on a miss, the durable correlation record (a flushed Redis must
   not turn a valid callback away);
6. the event is written into the session's inbox (create-only: a redelivery is answered
   200 ``duplicate`` and activates nothing) and appended to the audit chain;
7. only then the answer (202) goes out, and the activation is requested behind it.

Nothing before step 6 changes any state but the replay claim, which is given back if the
request then fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from torpor.errors import RejectReason, UnknownCorrelation, WebhookRejected
from torpor.events import EventKind, InboxEvent
from torpor.ports import WaitBinding
from torpor.service.sessions import SessionService
from torpor.settings import SourceConfig
from torpor.webhooks.capability import open_token
from torpor.webhooks.cloudevents import parse_http
from torpor.webhooks.payloads import InboundEvent, loads_json
from torpor.webhooks.rejections import ensure_body_size
from torpor.webhooks.signing import Scheme, Verified, verify

log = logging.getLogger(__name__)

CAPABILITY_SOURCE = "capability"
GITHUB_REPLAY_TTL = timedelta(hours=24)  # GitHub signs no timestamp: remember longer


@dataclass(frozen=True)
class Routed:
    event_id: str
    session_id: str | None
    duplicate: bool
    status: int  # per event: 202 accepted, 200 duplicate, 404 unknown


@dataclass(frozen=True)
class HookResult:
    status: int
    body: dict[str, Any] = field(default_factory=dict)


class WebhookGateway:
    """Inbound webhooks and capability callbacks, in the order the module describes."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self.audit = sessions.services.audit
        self._handled = sessions.services.observer.webhook_handled

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
            return await self._receive(source_name, body, headers, now)
        except WebhookRejected as exc:
            await self._handled(source_name, "rejected", exc.reason.value)
            raise

    async def _receive(
        self, source_name: str, body: bytes, headers: Mapping[str, str], now: datetime
    ) -> HookResult:
        source = self.source(source_name)
        ensure_body_size(len(body), limit=source.max_body_bytes)
        verified = verify(
            source.scheme,
            body,
            headers,
            source.secret_values(),
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
        )
        claims, ttl = self._replay_claims(source_name, source, verified)
        first = events[0]
        # The replay claims and the first event's routing share one index round trip.
        admission = await self.services.index.admit(
            claims=claims,
            ttl=ttl,
            now=now,
            tenant=source.tenant,
            correlation_id=first.correlation_id,
            business_key=None if first.correlation_id else first.business_key,
        )
        if not admission.fresh:
            raise WebhookRejected(RejectReason.REPLAYED)
        try:
            body_sha = hashlib.sha256(body).hexdigest()
            trace = _trace_id(headers)
            routed = []
            for i, event in enumerate(events):
                binding = (
                    admission.binding or await self._durable(source.tenant, event)
                    if i == 0
                    else await self._resolve(source.tenant, event, now)
                )
                routed.append(
                    await self._route(source_name, binding, event, verified, body_sha, trace, now)
                )
        except BaseException:
            for scope, nonce in claims:  # nothing was accepted: let a retry through
                await self.services.index.release_nonce(scope=scope, nonce=nonce)
            raise
        return await self._answer(routed, batch=len(events) > 1, tenant=source.tenant)

    def _replay_claims(
        self, source_name: str, source: SourceConfig, verified: Verified
    ) -> tuple[list[tuple[str, str]], timedelta]:
        ttl = (
            GITHUB_REPLAY_TTL
            if source.scheme is Scheme.GITHUB
            else timedelta(seconds=max(900.0, 3 * source.tolerance_s))
        )
        claims = [(f"hook:{source_name}", verified.content_digest)]
        # The torpor nonce is not covered by the signature, so it cannot stand alone; but
        # reusing one is itself a replay by the scheme's rules.
        if source.scheme is Scheme.TORPOR and verified.delivery_id:
            claims.append((f"nonce:{source_name}", verified.delivery_id))
        return claims, ttl

    async def _resolve(self, tenant: str, event: InboundEvent, now: datetime) -> WaitBinding | None:
        index = self.services.index
        found = None
        if event.correlation_id:
            found = await index.resolve(tenant=tenant, now=now, correlation_id=event.correlation_id)
        elif event.business_key:
            found = await index.resolve(tenant=tenant, now=now, business_key=event.business_key)
        return found or await self._durable(tenant, event)

    async def _durable(self, tenant: str, event: InboundEvent) -> WaitBinding | None:
        """After an index miss the durable correlation record decides, never the miss: a
        flushed Redis must not turn a valid callback away."""
        records = self.services.correlations
        if event.correlation_id:
            record = await records.lookup(event.correlation_id)
            return record if record is not None and record.tenant == tenant else None
        if event.business_key:
            return await records.lookup_business_key(tenant=tenant, business_key=event.business_key)
        return None

    async def _route(
        self,
        source_name: str,
        binding: WaitBinding | None,
        event: InboundEvent,
        verified: Verified,
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
        if binding is None:
            # Unknown, or another tenant's: the same 404 either way, and on the record.
            await self.audit.append(verdict="unknown", **audit)
            await self._handled(source_name, "unknown")
            return Routed(event.event_id, None, False, 404)
        data: Any = event.data
        if event.status is not None and isinstance(data, dict) and "status" not in data:
            data = {**data, "status": event.status}
        new = await self.sessions.services.inbox.deliver(
            InboxEvent.new(
                kind=EventKind.CALLBACK,
                session_id=binding.session_id,
                source=source_name,
                event_id=event.event_id,
                type=event.type,
                received_at=now,
                correlation_id=binding.correlation_id,
                business_key=event.business_key,
                epoch=binding.epoch,
                step_id=binding.step_id,
                data=data,
                trace_id=trace,
                verified_by=verified.scheme.value,
            )
        )
        record = self.audit.append(
            verdict="accepted" if new else "duplicate",
            session_id=binding.session_id,
            **{**audit, "correlation_id": binding.correlation_id},
        )
        if new:
            await self._handled(source_name, "accepted")
            # The event is durable already: the activation and the audit block go together.
            await asyncio.gather(record, self.sessions.activate_for_event(binding.session_id))
        else:
            await self._handled(source_name, "duplicate")
            await record
        return Routed(event.event_id, binding.session_id, not new, 202 if new else 200)

    async def _answer(self, routed: list[Routed], *, batch: bool, tenant: str) -> HookResult:
        body: dict[str, Any]
        if batch:
            body = {
                "events": [
                    {"event_id": r.event_id, "status": r.status, "duplicate": r.duplicate}
                    for r in routed
                ]
            }
            return HookResult(202 if any(r.status == 202 for r in routed) else 200, body)
        [one] = routed
        if one.status == 404:
            raise UnknownCorrelation("no open wait matches this event")
        body = {"event_id": one.event_id, "duplicate": one.duplicate}
        if one.duplicate and one.session_id:
            body["session"] = await self.outcome(one.session_id, tenant)
        return HookResult(one.status, body)

    async def outcome(self, session_id: str, tenant: str) -> dict[str, Any]:
        """What a late or duplicate sender is told: the session's real outcome."""
        snapshot = await self.sessions.get(session_id, tenant=tenant)
        return {"state": snapshot.state.value, "result": snapshot.result}

    # -- capability callbacks --------------------------------------------------------

    async def capability(
        self, token: str, body: bytes, headers: Mapping[str, str], *, now: datetime
    ) -> HookResult:
        try:
            return await self._capability(token, body, headers, now)
        except WebhookRejected as exc:
            await self._handled(CAPABILITY_SOURCE, "rejected", exc.reason.value)
            raise

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
        new = await self.services.inbox.deliver(
            InboxEvent.new(
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
            )
        )
        await self.audit.append(
            verdict="accepted" if new else "rejected:token_used",
            at=now,
            source=CAPABILITY_SOURCE,
            event_id=claims.token_id,
            session_id=claims.session_id,
            correlation_id=claims.correlation_id,
            body_sha256=hashlib.sha256(body).hexdigest(),
            trace_id=_trace_id(headers),
        )
        if not new:  # the inbox object is the durable proof the token was used
            raise WebhookRejected(RejectReason.TOKEN_USED)
        await self._handled(CAPABILITY_SOURCE, "accepted")
        await self.sessions.activate_for_event(claims.session_id)
        return HookResult(202, {"event_id": claims.token_id, "duplicate": False})


def _trace_id(headers: Mapping[str, str]) -> str | None:
    """The trace id of a W3C ``traceparent`` header, if the sender sent one."""
    lowered = {k.lower(): v for k, v in headers.items()}
    parts = lowered.get("traceparent", "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and all(c in "0123456789abcdef" for c in parts[1]):
        return parts[1]
    return None
