"""Delivery records of outbound notifications, and endpoint state, in the object store.

One object per delivery (``deliveries/{tenant}/{id}``), updated by compare-and-swap so
that the delivery worker and an operator's "resend" never overwrite each other.

Dead letters are indexed: an empty marker ``dead-letters/{tenant}/{id}`` exists while a
delivery is dead, so ``list(status=DEAD)`` reads one page of markers and their
deliveries instead of every delivery of the tenant. The marker is written *before* the
delivery turns dead and removed *after* it leaves that state, so a crash in between
leaves at worst a stale marker (the listing checks each delivery's status and skips it),
never a dead letter the listing cannot find.

Pending deliveries are indexed the same way (``pending-deliveries/{tenant}/{id}``, written
before a delivery is made or turned pending, removed after it leaves that state): the
reconciler's repair restores their timers from a page of markers, where it read every
delivery the tenant ever had at every periodic repair. Deliveries made before the
markers existed have none: ``list(status=PENDING, full=True)`` still reads them all, as
the repair does once the index was lost.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from storage import keys
from torpor.deliveries import Delivery, DeliveryStatus, EndpointState
from torpor.errors import EtagMismatch, NotFound, ObjectExists, ObjectNotFound
from torpor.ports import ObjectStore

MAX_CAS_ATTEMPTS = 10
# The most deliveries one filtered page reads: past it the page ends short, and its cursor
# goes on from the last one read (a filter that matches little read every delivery the
# tenant had, one object at a time, in one request).
SCAN_MAX = 1000


class ObjectDeliveries:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    async def create(self, delivery: Delivery) -> bool:
        """Create-only: False if this delivery already exists (an outbox replay)."""
        # The session's ref first (for retention): a crash after it leaves an empty ref
        # that retention skips, never a delivery retention cannot find.
        await self.store.put(
            keys.delivery_ref(delivery.session_id, delivery.tenant, delivery.delivery_id), b""
        )
        if delivery.status is DeliveryStatus.PENDING:
            await self.store.put(keys.pending_delivery(delivery.tenant, delivery.delivery_id), b"")
        try:
            await self.store.put_if_absent(
                keys.delivery(delivery.tenant, delivery.delivery_id),
                delivery.model_dump_json().encode(),
            )
        except ObjectExists:
            return False
        return True

    async def get(self, tenant: str, delivery_id: str) -> Delivery:
        try:
            obj = await self.store.get(keys.delivery(tenant, delivery_id))
            return Delivery.model_validate_json(obj.data)
        except (ObjectNotFound, ValidationError):
            raise NotFound(f"no delivery {delivery_id[:80]!r}") from None

    async def update(
        self, tenant: str, delivery_id: str, change: Callable[[Delivery], Delivery]
    ) -> Delivery:
        """Read, change, compare-and-swap; retried if someone else wrote in between."""
        key = keys.delivery(tenant, delivery_id)
        for _ in range(MAX_CAS_ATTEMPTS):
            try:
                obj = await self.store.get(key)
            except ObjectNotFound:
                raise NotFound(f"no delivery {delivery_id[:80]!r}") from None
            old = Delivery.model_validate_json(obj.data)
            new = change(old)
            markers = {
                DeliveryStatus.DEAD: keys.dead_letter(tenant, delivery_id),
                DeliveryStatus.PENDING: keys.pending_delivery(tenant, delivery_id),
            }
            if new.status in markers and old.status is not new.status:
                await self.store.put(markers[new.status], b"")  # before: never unfindable
            try:
                await self.store.put_if_match(key, new.model_dump_json().encode(), etag=obj.etag)
            except EtagMismatch:
                continue
            if old.status in markers and new.status is not old.status:
                await self.store.delete(markers[old.status])  # after: at worst a stale one
            return new
        raise EtagMismatch(f"delivery {delivery_id} is too contended to update")

    async def _marked(
        self, tenant: str, status: DeliveryStatus, *, cursor: str | None, limit: int
    ) -> tuple[list[Delivery], str | None]:
        """Dead letters or pending deliveries through their markers: reads ``limit``
        markers and deliveries, plus any stale marker met on the way, up to SCAN_MAX in
        all (then the page ends short, its cursor at the last marker read: a run of stale
        markers was read whole in one request)."""
        out: list[Delivery] = []
        if status is DeliveryStatus.DEAD:
            prefix = keys.dead_letter_prefix(tenant)
        else:
            prefix = keys.pending_delivery_prefix(tenant)
        token = prefix + keys.safe(cursor, "delivery id") if cursor else None
        scanned = 0
        while len(out) < limit:
            page = await self.store.list(prefix, start_after=token, limit=limit - len(out))
            for key in page.keys:
                scanned += 1
                try:
                    delivery = await self.get(tenant, key[len(prefix) :])
                except NotFound:
                    delivery = None
                if delivery is not None and delivery.status is status:
                    out.append(delivery)
                if scanned >= SCAN_MAX and len(out) < limit:
                    return out, key[len(prefix) :]
            if page.next_token is None or not page.keys:
                return out, None
            token = page.keys[-1]
        return out, out[-1].delivery_id

    async def list(
        self,
        tenant: str,
        *,
        status: DeliveryStatus | None,
        cursor: str | None,
        limit: int,
        full: bool = False,
    ) -> tuple[list[Delivery], str | None]:
        """A page of the tenant's deliveries, of ``status`` if given. Dead and pending
        ones through their markers, unless ``full`` (every delivery read: those made
        before the markers existed have none)."""
        if status is DeliveryStatus.DEAD or (status is DeliveryStatus.PENDING and not full):
            return await self._marked(tenant, status, cursor=cursor, limit=limit)
        out: list[Delivery] = []
        token = keys.delivery(tenant, cursor) if cursor else None
        prefix = keys.delivery_prefix(tenant)
        scanned = 0
        while len(out) < limit:
            page = await self.store.list(prefix, start_after=token, limit=200)
            for key in page.keys:
                scanned += 1
                try:
                    delivery = Delivery.model_validate_json((await self.store.get(key)).data)
                except (ObjectNotFound, ValidationError):
                    delivery = None
                if delivery is not None and (status is None or delivery.status is status):
                    out.append(delivery)
                    if len(out) == limit:
                        return out, delivery.delivery_id
                if scanned >= SCAN_MAX:
                    return out, key[len(prefix) :]
            if page.next_token is None:
                return out, None
            token = page.next_token
        return out, None

    async def endpoint(self, tenant: str, url: str) -> EndpointState:
        try:
            obj = await self.store.get(keys.endpoint_state(tenant, url))
            return EndpointState.model_validate_json(obj.data)
        except (ObjectNotFound, ValidationError):
            return EndpointState(url=url)

    async def set_endpoint(self, tenant: str, state: EndpointState) -> None:
        await self.store.put(
            keys.endpoint_state(tenant, state.url), state.model_dump_json().encode()
        )
