"""Replay protection of webhook requests: fast claims in the index, durable memory beside.

A request's signed content (and, for the torpor scheme, its nonce) is claimed in the index
(``SET NX EX``) before anything is routed. A claim that is already held is not by itself a
replay: its holder may have died before storing anything, and refusing the sender's
byte-identical retry would lose the event. What decides is the durable memory, one marker
per request that was accepted in full (``InboxRepository.remember_accepted``), written
after the request's events are in the inbox and their wake timers armed, beside their
audit records (taken back if one of those fails); it also
outlives a flushed index, so a replay after index loss is still refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from torpor.errors import RejectReason, WebhookRejected
from torpor.ports import Admission
from torpor.ports.services import Services
from torpor.settings import SourceConfig
from torpor.webhooks.signing import Scheme, Verified

GITHUB_REPLAY_TTL = timedelta(hours=24)  # GitHub signs no timestamp: remember longer


@dataclass(frozen=True)
class ReplayClaims:
    """What one request claims: (scope, value) pairs, the content digest first."""

    source: str
    content_digest: str
    pairs: list[tuple[str, str]]
    ttl: timedelta


def replay_claims(source_name: str, source: SourceConfig, verified: Verified) -> ReplayClaims:
    ttl = (
        GITHUB_REPLAY_TTL
        if source.scheme is Scheme.GITHUB
        else timedelta(seconds=max(900.0, 3 * source.tolerance_s))
    )
    pairs = [(f"hook:{source_name}", verified.content_digest)]
    # The torpor nonce is not covered by the signature, so it cannot stand alone; but
    # reusing one is itself a replay by the scheme's rules.
    if source.scheme is Scheme.TORPOR and verified.delivery_id:
        pairs.append((f"nonce:{source_name}", verified.delivery_id))
    return ReplayClaims(source_name, verified.content_digest, pairs, ttl)


class ReplayGuard:
    def __init__(self, services: Services) -> None:
        self.services = services

    async def held(self, claims: ReplayClaims, *, now: datetime) -> bool:
        """A claim was already held. Refuse if this exact request was accepted, or if only
        the nonce is held (another request used it); otherwise the holder never finished
        (it died, or is still at it) and this request goes on: the inbox is create-only,
        so the two cannot store an event twice. True if this request now holds the claims
        itself (its holder gave them back meanwhile): it gives them back if it fails."""
        if await self.services.inbox.was_accepted(
            source=claims.source, content_digest=claims.content_digest
        ):
            raise WebhookRejected(RejectReason.REPLAYED)
        if len(claims.pairs) == 1:
            return False
        content, nonce = claims.pairs
        if not (await self._take([content], claims, now=now)).fresh:
            return False
        # The content was free. A free nonce too is not another request's: this request's
        # earlier try gave both back since the first look (``release`` gives the nonce
        # back first, so a free content means a freed nonce). Only a nonce still held is.
        if (await self._take([nonce], claims, now=now)).fresh:
            return True
        await self.services.index.release_nonce(scope=content[0], nonce=content[1])
        raise WebhookRejected(RejectReason.REPLAYED)

    async def _take(
        self, pairs: list[tuple[str, str]], claims: ReplayClaims, *, now: datetime
    ) -> Admission:
        return await self.services.index.admit(
            claims=pairs,
            ttl=claims.ttl,
            now=now,
            tenant="",
            correlation_id=None,
            business_key=None,
        )

    async def release(self, claims: ReplayClaims) -> None:
        """Give the claims back: the request failed, a retry must get through. The nonce
        first: a release cut short then leaves the content held, which ``held`` reads as a
        holder that never finished; a nonce left alone it would read as another request's,
        and refuse the sender's retry of a request that stored nothing as a replay."""
        for scope, nonce in reversed(claims.pairs):
            await self.services.index.release_nonce(scope=scope, nonce=nonce)

    async def remember(self, claims: ReplayClaims, *, at: datetime, in_inbox: bool) -> bool:
        """The request (received ``at``) was accepted in full: its bytes are a replay from
        now on. True if this call wrote the marker (False: it was there already).
        ``in_inbox``: it stored an inbox event, which names the marker."""
        return await self.services.inbox.remember_accepted(
            source=claims.source, content_digest=claims.content_digest, at=at, in_inbox=in_inbox
        )

    async def forget(self, claims: ReplayClaims) -> None:
        """Take back a marker this request wrote: the request failed after all."""
        await self.services.inbox.forget_accepted(
            source=claims.source, content_digest=claims.content_digest
        )

    async def was_accepted(self, claims: ReplayClaims) -> bool:
        return await self.services.inbox.was_accepted(
            source=claims.source, content_digest=claims.content_digest
        )
