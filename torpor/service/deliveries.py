"""Delivering outbound notifications: enqueue from the outbox, attempt in a worker.

The runtime's outbox hands a NOTIFY entry to ``DeliveryNotifier.enqueue``, which only
writes a durable delivery and schedules it: a slow or dead receiver never holds up a
session. ``DeliveryWorker`` attempts due deliveries in the background, a bounded number
at once, so a slow receiver never holds up the sweep either. One attempt is one signed
POST under an overall deadline: 2xx delivers, 410 disables the endpoint, anything else
(3xx included: redirects are never followed, wherever they point; a timeout; a garbage
answer) is a failed attempt with its ``Failure`` category and schedules the next one per
the retry schedule or a longer ``Retry-After``; after the last attempt the delivery is a
dead letter until someone resends it. A resolution failure of the callback's host is a
failed attempt too (DNS trouble passes); only a policy refusal (the host resolves to a
private address) makes a dead letter at once.

What a tenant sees of an attempt is its ``Failure`` category only (``tenant_view``): the
raw status and error text would let a tenant probe what answers behind a callback URL.
Both are stored for operators (``last_error``, each history record's ``error``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import ssl
import time
import urllib.error
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from torpor.deliveries import Delivery, DeliveryStatus, EndpointState, delivery_id_for
from torpor.errors import (
    ConfigError,
    DeliveryNotResendable,
    NotFound,
    OutboundBusy,
    ResolversBusy,
    ResponseTooLarge,
    UnsafeUrl,
)
from torpor.faults import CrashPoint, crash_point
from torpor.models import OutboxEntry, SessionSnapshot
from torpor.notify import MAX_RETRY_AFTER_S, RETRY_BACKOFF, endpoint_secret, payload
from torpor.outbound import Response, request_async, retry_after_s
from torpor.ports import TimerKind
from torpor.ports.services import Services
from torpor.settings import Settings, resolve_secret
from torpor.ssrf import vetted_address
from torpor.webhooks.signing import Scheme, sign

log = logging.getLogger(__name__)
# What an operator may send again: a delivery that gave up, or whose endpoint said 410.
RESENDABLE = frozenset({DeliveryStatus.DEAD, DeliveryStatus.DISABLED})


def ensure_resendable(delivery: Delivery) -> None:
    """``DeliveryNotResendable`` unless an operator may send ``delivery`` again: a
    delivered one would be sent twice, a pending one given fresh attempts for ever."""
    if delivery.status not in RESENDABLE:
        raise DeliveryNotResendable(
            f"delivery {delivery.delivery_id} is {delivery.status.value}: only a dead or"
            " disabled one is sent again"
        )


CONCURRENT_ATTEMPTS = 8


def timer_member(tenant: str, delivery_id: str) -> str:
    return f"{tenant}|{delivery_id}"


def secret_for(settings: Settings, tenant: str, url: str) -> str:
    if settings.notifications.key is None:
        raise ConfigError("notifications need notify_key in the configuration")
    return endpoint_secret(resolve_secret(settings.notifications.key).encode(), tenant, url)


class DeliveryNotifier:
    """The runtime's ``Notifier``: durable enqueue, nothing sent inline."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.deliveries = services.deliveries

    async def enqueue(self, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
        # A tool's notice names its receiver (configured with the tool, e.g. the OA's
        # reminder endpoint); the session's own notices go to the submitter's callback.
        url = entry.payload.get("url") or snapshot.callback_url
        if not isinstance(url, str) or not url:
            return
        now = self.services.clock.now()
        event = str(entry.payload.get("event", snapshot.state.value))
        body = payload(snapshot, event=event, now=now)
        tool_data = entry.payload.get("data")
        if "url" in entry.payload and isinstance(tool_data, dict):
            body = {"type": event, "timestamp": body["timestamp"], "data": tool_data}
        delivery = Delivery(
            delivery_id=delivery_id_for(entry.idempotency_key),
            tenant=snapshot.tenant,
            session_id=snapshot.session_id,
            url=url,
            event_type=event if "url" in entry.payload else f"session.{event.lower()}",
            payload=body,
            next_attempt_at=now,
            created_at=now,
        )
        created = await self.deliveries.create(delivery)
        crash_point(CrashPoint.DELIVERY_CREATED)
        # An outbox replay finds it there already, maybe attempted and backed off (a
        # receiver's Retry-After): its timer is made sure of, never moved to now. (One
        # that a crash left without a timer gets one now; ``attempt`` keeps to the
        # delivery's own next attempt time.)
        await self.services.index.schedule(
            kind=TimerKind.DELIVER,
            member=timer_member(snapshot.tenant, delivery.delivery_id),
            at=now,
            if_absent=not created,
        )


class Failure(StrEnum):
    """Why one delivery attempt failed: every failure is an attempt, never an exception.
    This category is all a tenant sees of a failed attempt."""

    TIMEOUT = "timeout"  # no complete answer within the attempt's deadline
    DNS = "dns"  # the host did not resolve (retried: DNS trouble passes)
    CONNECTION_REFUSED = "connection_refused"
    CONNECTION = "connection"  # reset, unreachable
    TLS = "tls"  # handshake or certificate check failed
    PROTOCOL = "protocol"  # not HTTP: a garbage status line, a truncated answer
    REDIRECT = "redirect"  # a 3xx: never followed (it may point anywhere, inside too)
    HTTP_4XX = "http_4xx"
    HTTP_5XX = "http_5xx"
    POLICY = "refused_by_policy"  # the callback resolves to a private address
    DISABLED = "endpoint_disabled"
    INTERNAL = "internal"  # our own side failed (signing, configuration, no free thread)


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason  # urllib wraps the transport's own exception
    if isinstance(exc, UnsafeUrl):
        return Failure.POLICY
    if isinstance(exc, (ResolversBusy, OutboundBusy)):
        # Checked first: an OSError and a TimeoutError. No thread of ours was free in
        # time; told "connection" or "timeout", a tenant looked for a fault in its own
        # endpoint.
        return Failure.INTERNAL
    if isinstance(exc, TimeoutError):
        return Failure.TIMEOUT
    if isinstance(exc, (http.client.HTTPException, ResponseTooLarge)):
        return Failure.PROTOCOL
    if isinstance(exc, socket.gaierror):
        return Failure.DNS
    if isinstance(exc, ssl.SSLError):
        return Failure.TLS
    if isinstance(exc, ConnectionRefusedError):
        return Failure.CONNECTION_REFUSED
    if isinstance(exc, OSError):
        return Failure.CONNECTION
    return Failure.INTERNAL


def answer_category(status: int) -> Failure:
    """The category of a non-2xx answer."""
    if 300 <= status < 400:
        return Failure.REDIRECT
    return Failure.HTTP_4XX if status < 500 else Failure.HTTP_5XX


def tenant_view(delivery: Delivery) -> dict[str, Any]:
    """A delivery as its tenant sees it: each attempt's category, never its raw status
    or error text (operators read those from the stored delivery)."""
    view = delivery.model_dump(
        mode="json", exclude={"payload", "last_status", "last_error", "history"}
    )
    view["history"] = [
        {"at": record.get("at"), "category": record.get("category")} for record in delivery.history
    ]
    return view


@dataclass
class _Round:
    """What one ``start_due`` may still take, shared by the lanes it started."""

    left: int
    taken: int = 0


class DeliveryWorker:
    """Attempts due deliveries and resends dead ones (an operator).

    The sweeper hands it due deliveries with ``start_due``, which returns at once: the
    attempts run in this worker's lanes, ``concurrency`` at once, each under an overall
    deadline (``notifications.timeout_s``). A lane takes a delivery timer only when it is
    free to attempt it, and the timer is leased from then for the attempt's deadline and
    the grace, so no attempt outlives its lease; it is removed only once the attempt
    settled the delivery, so an attempt cut short by a crash is made again.
    """

    def __init__(self, services: Services, *, concurrency: int = CONCURRENT_ATTEMPTS) -> None:
        self.services = services
        self.deliveries = services.deliveries
        self._concurrency = concurrency
        self._taking = asyncio.Lock()
        self._lanes: set[asyncio.Task[None]] = set()
        self._attempting: set[str] = set()

    @property
    def lease(self) -> timedelta:
        """How long a taken delivery timer waits for its attempt before it is due again."""
        settings = self.services.settings
        return timedelta(
            seconds=settings.notifications.timeout_s + settings.reconciler.wake_grace_s
        )

    async def start_due(self, now: datetime, limit: int = 100) -> int:
        """Take due deliveries, as many as there are free lanes, and attempt them in the
        background; each lane then takes the next due one as its attempt ends, ``limit``
        in all. Returns how many were started now."""
        return (await self._start(now, limit)).taken

    async def _start(self, now: datetime, limit: int) -> _Round:
        round_ = _Round(left=limit)
        # Under the lock: two calls at once never see the same lanes free.
        async with self._taking:
            members, until = await self._take(now, self._concurrency - len(self._lanes), round_)
            for member in members:
                lane = asyncio.create_task(self._lane(member, until, round_))
                self._lanes.add(lane)
                lane.add_done_callback(self._lanes.discard)
        return round_

    async def _take(self, now: datetime, room: int, round_: _Round) -> tuple[list[str], datetime]:
        """Lease up to ``room`` due timers for attempts that start now. Only a free lane
        takes one: taken ahead of their turn (100 for 8 lanes), those that waited behind
        slow receivers outlived their lease, and another sweeper posted them too."""
        room = min(room, round_.left)
        # The lease runs from the take (the clock, not a sweep's ``now``: an earlier step
        # of that sweep may have taken a while).
        until = self.services.clock.now() + self.lease
        if room <= 0:
            return [], until
        members = await self.services.index.lease_due(
            kind=TimerKind.DELIVER, now=now, limit=room, until=until
        )
        round_.left -= len(members)
        # One still being attempted here (its lease ran out) is not attempted twice.
        fresh = [member for member in members if member not in self._attempting]
        round_.taken += len(fresh)
        return fresh, until

    async def _lane(self, member: str, until: datetime, round_: _Round) -> None:
        """Attempt ``member``, then the next due delivery, one at a time, while the round
        allows and one is due."""
        while True:
            self._attempting.add(member)
            try:
                await self._attempt_member(member, until)
            finally:
                self._attempting.discard(member)
            try:
                members, until = await self._take(self.services.clock.now(), 1, round_)
            except Exception:  # storage trouble: the next sweep takes them
                log.exception("due deliveries could not be taken")
                return
            if not members:
                return
            [member] = members

    async def due(self, now: datetime, limit: int = 100) -> int:
        """Attempt every due delivery and wait for the attempts (the CLI, tests); returns
        how many were attempted."""
        round_ = await self._start(now, limit)
        await self.drain()
        return round_.taken

    async def drain(self) -> None:
        """Wait for the attempts under way."""
        while self._lanes:
            await asyncio.gather(*list(self._lanes), return_exceptions=True)

    async def _attempt_member(self, member: str, leased_until: datetime) -> None:
        tenant, _, delivery_id = member.partition("|")
        try:
            delivery = await self.attempt(tenant, delivery_id, now=self.services.clock.now())
            if delivery.status is not DeliveryStatus.PENDING:
                await self.services.index.unschedule(
                    kind=TimerKind.DELIVER, member=member, if_at=leased_until
                )
        except NotFound:  # nothing left to deliver
            await self.services.index.unschedule(kind=TimerKind.DELIVER, member=member)
        except Exception:  # storage trouble: the leased timer brings the attempt back
            log.exception("delivery %s could not be attempted", member)

    async def attempt(self, tenant: str, delivery_id: str, *, now: datetime) -> Delivery:
        """One attempt of a pending delivery, settled as delivered, failed (with a retry
        or as a dead letter) or disabled. Only storage failures raise."""
        delivery = await self.deliveries.get(tenant, delivery_id)
        if delivery.status is not DeliveryStatus.PENDING:
            return delivery
        due = delivery.next_attempt_at
        if due is not None and due > now:
            # Early (a timer moved by a replay, a second taker): the backoff and the
            # receiver's Retry-After stand. The timer goes back to the due time.
            await self.services.index.schedule(
                kind=TimerKind.DELIVER, member=timer_member(tenant, delivery_id), at=due
            )
            return delivery
        endpoint = await self.deliveries.endpoint(tenant, delivery.url)
        if endpoint.disabled:
            return await self._settle(
                delivery, DeliveryStatus.DISABLED, None, Failure.DISABLED, "endpoint disabled", now
            )
        failure: Failure | None
        try:
            response = await self._post(delivery)
        except UnsafeUrl as exc:  # policy: no later attempt can be allowed either
            refusal = f"{Failure.POLICY}: {exc}"[:300]
            return await self._settle(
                delivery, DeliveryStatus.DEAD, None, Failure.POLICY, refusal, now
            )
        except Exception as exc:  # every failure of the attempt is a failed attempt
            status, retry_after, failure = 0, None, classify(exc)
            error: str | None = f"{failure}: {type(exc).__name__}: {exc}"[:300]
        else:
            status, retry_after = response.status, response.header("Retry-After")
            failure = None if response.ok else answer_category(status)
            error = None if failure is None else f"{failure}: HTTP {status}"
        if 200 <= status < 300:
            return await self._settle(delivery, DeliveryStatus.DELIVERED, status, None, None, now)
        if status == 410:
            await self.deliveries.set_endpoint(
                tenant,
                EndpointState(url=delivery.url, disabled=True, disabled_at=now, reason="410 Gone"),
            )
            return await self._settle(
                delivery, DeliveryStatus.DISABLED, status, failure, "410 Gone", now
            )
        if RETRY_BACKOFF.exhausted(delivery.attempts):
            return await self._settle(delivery, DeliveryStatus.DEAD, status, failure, error, now)
        delay = RETRY_BACKOFF.delay_s(delivery.attempts)
        asked = retry_after_s(retry_after, now=now, cap_s=MAX_RETRY_AFTER_S)
        if asked is not None:
            delay = max(delay, asked)
        at = now + timedelta(seconds=delay)
        updated = await self._settle(
            delivery, DeliveryStatus.PENDING, status, failure, error, now, at
        )
        await self.services.index.schedule(
            kind=TimerKind.DELIVER, member=timer_member(tenant, delivery_id), at=at
        )
        return updated

    async def _post(self, delivery: Delivery) -> Response:
        settings = self.services.settings
        body = json.dumps(delivery.payload, separators=(",", ":")).encode()
        # One deadline for the whole attempt: the wait for a resolver thread, the name's
        # resolution, the wait for an outbound thread and the request. Each bounded on
        # its own, they added up past the timer's lease (timeout_s + wake_grace_s), and
        # another process took the timer and posted the same delivery again.
        timeout_s = settings.notifications.timeout_s
        ends = time.monotonic() + timeout_s
        # The addresses vetted here are those dialled: resolving again to connect would
        # let a rebinding name swap in a private address after the check.
        addresses = await vetted_address(
            delivery.url,
            allow_private=settings.notifications.allow_private_callbacks,
            timeout_s=timeout_s,
            ends=ends,
        )
        # Signed now, not when the attempt began: receivers refuse a stale timestamp.
        headers = sign(
            Scheme.STANDARD,
            body,
            secret_for(settings, delivery.tenant, delivery.url),
            now=self.services.clock.now(),
            msg_id=delivery.delivery_id,
        )
        headers["Content-Type"] = "application/json"
        headers["User-Agent"] = "torpor-notifier/1"
        # A 3xx is a failed attempt: the helper never follows it. The answer's body is of
        # no interest, so it is not read. The wait for an outbound thread counts against
        # what is left of the deadline (``request_async``).
        return await request_async(
            "POST",
            delivery.url,
            body=body,
            headers=headers,
            timeout_s=max(0.001, ends - time.monotonic()),
            max_body_bytes=0,
            connect_to=addresses,
        )

    async def _settle(
        self,
        delivery: Delivery,
        status: DeliveryStatus,
        http_status: int | None,
        failure: Failure | None,
        error: str | None,
        now: datetime,
        next_at: datetime | None = None,
    ) -> Delivery:
        def change(d: Delivery) -> Delivery:
            category = None if failure is None else failure.value
            record = {
                "at": now.isoformat(),
                "status": http_status,
                "category": category,
                "error": error,
            }
            return d.model_copy(
                update={
                    "status": status,
                    "attempts": d.attempts + 1,
                    "last_status": http_status,
                    "last_error": error,
                    "last_category": category,
                    "next_attempt_at": next_at,
                    "delivered_at": now if status is DeliveryStatus.DELIVERED else None,
                    "history": [*d.history, record][-20:],
                }
            )

        updated = await self.deliveries.update(delivery.tenant, delivery.delivery_id, change)
        await self.services.observer.delivery_settled(updated)
        return updated

    async def resend(self, tenant: str, delivery_id: str, *, now: datetime) -> Delivery:
        """Operator action: give a dead or disabled delivery a fresh set of attempts."""
        delivery = await self.deliveries.get(tenant, delivery_id)
        ensure_resendable(delivery)
        endpoint = await self.deliveries.endpoint(tenant, delivery.url)
        if endpoint.disabled:
            await self.deliveries.set_endpoint(tenant, EndpointState(url=delivery.url))

        def change(d: Delivery) -> Delivery:
            # Checked again inside the compare-and-swap: two resends at once, or an
            # attempt settling meanwhile, change it once.
            ensure_resendable(d)
            return d.model_copy(
                update={"status": DeliveryStatus.PENDING, "attempts": 0, "next_attempt_at": now}
            )

        # The timer before the change: set after it only, a crash or an index error in
        # between left a pending delivery that no timer brought, and that a second resend
        # refused (it is pending). A timer that fires first finds it dead: nothing sent.
        member = timer_member(tenant, delivery_id)
        await self.services.index.schedule(kind=TimerKind.DELIVER, member=member, at=now)
        updated = await self.deliveries.update(tenant, delivery_id, change)
        crash_point(CrashPoint.DELIVERY_RESENT)
        # Again: an attempt that took the first timer before the change removed it.
        await self.services.index.schedule(kind=TimerKind.DELIVER, member=member, at=now)
        return updated
