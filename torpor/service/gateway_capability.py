"""The gateway's capability callbacks (``torpor.service.gateway``): an answer sent
through a signed single-use link, verified by its token, stored into the session's
inbox and woken; the same answer again is settled, a different one refused."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from datetime import datetime

from torpor.errors import RejectReason, WebhookRejected
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.service.gateway_edge import _trace_id, own_call_cancelled
from torpor.service.gateway_inbox import GatewayInbox
from torpor.service.gateway_outcomes import HookResult
from torpor.webhooks.capability import open_token
from torpor.webhooks.payloads import loads_json
from torpor.webhooks.rejections import ensure_body_size

CAPABILITY_SOURCE = "capability"


class GatewayCapability(GatewayInbox):
    """Capability callbacks: the answers sent through a signed link."""

    # -- capability callbacks --------------------------------------------------------

    async def capability(
        self, token: str, body: bytes, headers: Mapping[str, str], *, now: datetime
    ) -> HookResult:
        task = asyncio.current_task()
        try:
            return await self._capability(token, body, headers, now)
        except WebhookRejected as exc:
            await self._handled(CAPABILITY_SOURCE, "rejected", exc.reason.value)
            if exc.reason is not RejectReason.TOKEN_USED:  # that one is on the record already
                await self._audit_rejection(CAPABILITY_SOURCE, exc.reason, body, headers, now)
            raise
        except asyncio.CancelledError as exc:
            if not own_call_cancelled(task):
                raise
            raise await self._call_cancelled(CAPABILITY_SOURCE) from exc
        except Exception as exc:
            await self._failed(CAPABILITY_SOURCE, exc)
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
