"""The gateway's edge (``torpor.service.gateway``): the state every part of it shares,
the source a request names, and what is counted and put on the record of a request
refused (4xx) or failed (5xx); the trace id a request's headers carry."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from torpor import tracing
from torpor.errors import RejectReason, StorageUnavailable, TorporError, WebhookRejected
from torpor.service.replay import ReplayGuard
from torpor.service.sessions import SessionService
from torpor.settings import SourceConfig

log = logging.getLogger(__name__)


def own_call_cancelled(task: asyncio.Task[Any] | None) -> bool:
    """Whether a ``CancelledError`` that reached a request's handler is a call of its own
    cancelled under it (a store's call as the store closes), not the request's cancel:
    the request was not asked to cancel. That is a storage failure, for the sender to
    send again (503), where the cancel would pass every handler and answer nothing. A
    request that was asked (its sender gone, the replica stopping), or may have been,
    raises the cancel: a cancel raised too often beats one lost (``awaiting.settled``)."""
    return task is not None and not task.cancelling()


class GatewayEdge:
    """What every part of the gateway shares, and its refusals and failures."""

    def __init__(self, sessions: SessionService) -> None:
        self.sessions = sessions
        self.services = sessions.services
        self.audit = sessions.services.audit
        self._handled = sessions.services.observer.webhook_handled
        self.replays = ReplayGuard(sessions.services)
        self._receiving = 0  # webhooks in this gateway between their verify and answer

    def source(self, name: str) -> SourceConfig:
        source = self.services.settings.sources.get(name)
        if source is None:
            raise WebhookRejected(RejectReason.UNKNOWN_SOURCE)
        return source

    async def _failed(self, source: str, exc: Exception) -> None:
        """A webhook the edge answers 5xx (storage down, a bug) is counted as ``error``,
        so an alert sees senders being turned away; 4xx answers are counted where raised."""
        status = exc.status if isinstance(exc, TorporError) else 500
        if status >= 500:
            with contextlib.suppress(Exception):  # the original error is what the caller gets
                await self._handled(source, "error", type(exc).__name__)

    async def _call_cancelled(self, source: str) -> StorageUnavailable:
        """What a call of the request's own cancelled under it (``own_call_cancelled``)
        is answered with, counted as the 5xx it is."""
        failure = StorageUnavailable("a call this webhook made was cancelled; send it again")
        await self._failed(source, failure)
        return failure

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
        except asyncio.CancelledError:
            if not own_call_cancelled(asyncio.current_task()):
                raise
            # The audit's own write cancelled under it (the store closing): the 4xx
            # stands, as for any other failure of the audit.
            log.warning("audit of a rejected %s request was cancelled", source[:128])


def _trace_id(headers: Mapping[str, str]) -> str | None:
    """The trace id of a W3C ``traceparent`` header, if the sender sent one."""
    parts = tracing.carried(headers).get("traceparent", "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32 and all(c in "0123456789abcdef" for c in parts[1]):
        return parts[1]
    return None
