"""Delivering outbound notifications: enqueue from the outbox, attempt from the sweeper.

The runtime's outbox hands a NOTIFY entry to ``DeliveryNotifier.enqueue``, which only
writes a durable delivery and schedules it: a slow or dead receiver never holds up a
session. ``DeliveryWorker.attempt`` makes one signed POST: 2xx delivers, 410 disables the
endpoint, anything else (3xx included: redirects are not followed) schedules the next
attempt per the retry schedule or a longer ``Retry-After``; after the last attempt the
delivery is a dead letter until someone resends it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from datetime import datetime, timedelta

from torpor.deliveries import Delivery, DeliveryStatus, EndpointState
from torpor.errors import ConfigError, UnsafeUrl
from torpor.ids import digest
from torpor.models import OutboxEntry, SessionSnapshot
from torpor.notify import MAX_RETRY_AFTER_S, RETRY_BACKOFF, endpoint_secret, payload
from torpor.outbound import request_async, retry_after_s
from torpor.ports import TimerKind
from torpor.ports.services import Services
from torpor.settings import Settings, resolve_secret
from torpor.ssrf import check_callback_url
from torpor.webhooks.signing import Scheme, sign


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
        if not snapshot.callback_url:
            return
        now = self.services.clock.now()
        event = str(entry.payload.get("event", snapshot.state.value))
        delivery = Delivery(
            delivery_id="d_" + digest(entry.idempotency_key, length=24),
            tenant=snapshot.tenant,
            session_id=snapshot.session_id,
            url=snapshot.callback_url,
            event_type=f"session.{event.lower()}",
            payload=payload(snapshot, event=event, now=now),
            next_attempt_at=now,
            created_at=now,
        )
        await self.deliveries.create(delivery)  # an outbox replay finds it already there
        await self.services.index.schedule(
            kind=TimerKind.DELIVER,
            member=timer_member(snapshot.tenant, delivery.delivery_id),
            at=now,
        )


class DeliveryWorker:
    """Attempts due deliveries (from the sweeper) and resends dead ones (an operator)."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.deliveries = services.deliveries

    async def due(self, now: datetime, limit: int = 100) -> int:
        index = self.services.index
        members = await index.due(kind=TimerKind.DELIVER, now=now, limit=limit)
        for member in members:
            tenant, _, delivery_id = member.partition("|")
            await index.unschedule(kind=TimerKind.DELIVER, member=member)
            await self.attempt(tenant, delivery_id, now=now)
        return len(members)

    async def attempt(self, tenant: str, delivery_id: str, *, now: datetime) -> Delivery:
        settings = self.services.settings
        delivery = await self.deliveries.get(tenant, delivery_id)
        if delivery.status is not DeliveryStatus.PENDING:
            return delivery
        endpoint = await self.deliveries.endpoint(tenant, delivery.url)
        if endpoint.disabled:
            return await self._settle(
                delivery, DeliveryStatus.DISABLED, None, "endpoint disabled", now
            )
        body = json.dumps(delivery.payload, separators=(",", ":")).encode()
        error: str | None
        try:
            await asyncio.to_thread(
                check_callback_url,
                delivery.url,
                allow_private=settings.notifications.allow_private_callbacks,
            )
            headers = sign(
                Scheme.STANDARD,
                body,
                secret_for(settings, tenant, delivery.url),
                now=now,
                msg_id=delivery.delivery_id,
            )
            headers["Content-Type"] = "application/json"
            headers["User-Agent"] = "torpor-notifier/1"
            # A 3xx is a failed attempt: the helper never follows it. The answer's body
            # is of no interest, so it is not read.
            response = await request_async(
                "POST",
                delivery.url,
                body=body,
                headers=headers,
                timeout_s=settings.notifications.timeout_s,
                max_body_bytes=0,
            )
            status, retry_after = response.status, response.header("Retry-After")
        except UnsafeUrl as exc:
            return await self._settle(delivery, DeliveryStatus.DEAD, None, str(exc), now)
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, garbled
            status, retry_after = 0, None
            error = f"{type(exc).__name__}: {exc}"[:300]
        else:
            error = None if 200 <= status < 300 else f"HTTP {status}"
        if 200 <= status < 300:
            return await self._settle(delivery, DeliveryStatus.DELIVERED, status, None, now)
        if status == 410:
            await self.deliveries.set_endpoint(
                tenant,
                EndpointState(url=delivery.url, disabled=True, disabled_at=now, reason="410 Gone"),
            )
            return await self._settle(delivery, DeliveryStatus.DISABLED, status, "410 Gone", now)
        if RETRY_BACKOFF.exhausted(delivery.attempts):
            return await self._settle(delivery, DeliveryStatus.DEAD, status, error, now)
        delay = RETRY_BACKOFF.delay_s(delivery.attempts)
        asked = retry_after_s(retry_after, now=now, cap_s=MAX_RETRY_AFTER_S)
        if asked is not None:
            delay = max(delay, asked)
        at = now + timedelta(seconds=delay)
        updated = await self._settle(delivery, DeliveryStatus.PENDING, status, error, now, at)
        await self.services.index.schedule(
            kind=TimerKind.DELIVER, member=timer_member(tenant, delivery_id), at=at
        )
        return updated

    async def _settle(
        self,
        delivery: Delivery,
        status: DeliveryStatus,
        http_status: int | None,
        error: str | None,
        now: datetime,
        next_at: datetime | None = None,
    ) -> Delivery:
        def change(d: Delivery) -> Delivery:
            record = {"at": now.isoformat(), "status": http_status, "error": error}
            return d.model_copy(
                update={
                    "status": status,
                    "attempts": d.attempts + 1,
                    "last_status": http_status,
                    "last_error": error,
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
        endpoint = await self.deliveries.endpoint(tenant, delivery.url)
        if endpoint.disabled:
            await self.deliveries.set_endpoint(tenant, EndpointState(url=delivery.url))

        def change(d: Delivery) -> Delivery:
            return d.model_copy(
                update={"status": DeliveryStatus.PENDING, "attempts": 0, "next_attempt_at": now}
            )

        updated = await self.deliveries.update(tenant, delivery_id, change)
        await self.services.index.schedule(
            kind=TimerKind.DELIVER, member=timer_member(tenant, delivery_id), at=now
        )
        return updated
