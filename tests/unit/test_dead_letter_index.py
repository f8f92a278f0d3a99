"""Listing dead letters reads one page of objects, not every delivery of the tenant."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from storage import keys
from storage.deliveries import ObjectDeliveries
from storage.local_store import LocalObjectStore
from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import ObjectNotFound
from torpor.ports import StoredObject

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class CountingStore:
    """The real local store, counting the objects read."""

    def __init__(self, inner: LocalObjectStore) -> None:
        self.inner = inner
        self.reads = 0

    async def get(self, key: str, **kwargs: Any) -> StoredObject:
        self.reads += 1
        return await self.inner.get(key, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def delivery(n: int) -> Delivery:
    return Delivery(
        delivery_id=f"d_{n:04d}",
        tenant="acme",
        session_id="s_1",
        url="https://hooks.example/",
        event_type="session.completed",
        payload={},
        created_at=NOW,
    )


def to(status: DeliveryStatus) -> Any:
    return lambda d: d.model_copy(update={"status": status})


async def filled(tmp_path: Path, dead: list[int], total: int = 200) -> tuple[Any, CountingStore]:
    store = CountingStore(LocalObjectStore(tmp_path))
    deliveries = ObjectDeliveries(store)  # type: ignore[arg-type]
    for n in range(total):
        await deliveries.create(delivery(n))
        final = DeliveryStatus.DEAD if n in dead else DeliveryStatus.DELIVERED
        await deliveries.update("acme", f"d_{n:04d}", to(final))
    store.reads = 0
    return deliveries, store


async def test_a_page_of_dead_letters_reads_a_page_of_objects(tmp_path: Path) -> None:
    dead = [150, 170, 185, 190, 199]  # late in key order: a scan reads everything first
    deliveries, store = await filled(tmp_path, dead)
    page, cursor = await deliveries.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=2)
    assert [d.delivery_id for d in page] == ["d_0150", "d_0170"]
    assert store.reads <= 2, f"{store.reads} objects read for a page of 2"
    seen = [d.delivery_id for d in page]
    while cursor is not None:
        page, cursor = await deliveries.list(
            "acme", status=DeliveryStatus.DEAD, cursor=cursor, limit=2
        )
        seen += [d.delivery_id for d in page]
    assert seen == [f"d_{n:04d}" for n in dead]


async def test_a_resent_delivery_leaves_the_dead_letters(tmp_path: Path) -> None:
    deliveries, store = await filled(tmp_path, [3, 7], total=10)
    await deliveries.update("acme", "d_0003", to(DeliveryStatus.PENDING))
    page, cursor = await deliveries.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=5)
    assert [d.delivery_id for d in page] == ["d_0007"] and cursor is None
    with pytest.raises(ObjectNotFound):  # the marker of a resent delivery is removed
        await store.inner.get(keys.dead_letter("acme", "d_0003"))


async def test_a_stale_marker_is_skipped(tmp_path: Path) -> None:
    deliveries, store = await filled(tmp_path, [], total=4)
    await store.inner.put(keys.dead_letter("acme", "d_0001"), b"")  # a crash left it
    page, _ = await deliveries.list("acme", status=DeliveryStatus.DEAD, cursor=None, limit=5)
    assert page == []
