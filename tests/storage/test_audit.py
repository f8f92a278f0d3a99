"""The audit chain: concurrent appends stay one valid chain; any tampering shows."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime

import pytest

from storage import keys
from storage.audit import ObjectAudit
from torpor.errors import ObjectExists
from torpor.ports import ObjectStore


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest) -> ObjectStore:
    name = "local_store" if request.param == "local" else "s3_store"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def fields(i: int) -> dict[str, object]:
    return {
        "at": datetime.now(UTC),
        "source": "oa",
        "verdict": "accepted",
        "event_id": f"e-{i}",
        "body_sha256": hashlib.sha256(str(i).encode()).hexdigest(),
    }


async def test_concurrent_appends_form_one_valid_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w1")
    records = await asyncio.gather(*(log.append(**fields(i)) for i in range(300)))
    records += [await log.append(**fields(i)) for i in range(300, 305)]
    assert sorted(r.seq for r in records) == list(range(1, 306))
    check = await log.verify()
    assert check.ok and check.records == 305
    blocks = (await store.list(keys.audit_prefix("w1"))).keys
    assert 2 <= len(blocks) < 305, "records are group-committed into blocks"


async def test_editing_a_record_breaks_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w2")
    for i in range(5):
        await log.append(**fields(i))
    key = keys.audit_record("w2", 3)
    lines = (await store.get(key)).data.decode().splitlines()
    record = json.loads(lines[0])
    record["verdict"] = "duplicate"
    await store.put(key, "\n".join([json.dumps(record), *lines[1:]]).encode())
    check = await log.verify()
    assert not check.ok and check.broken_at == 3 and "altered" in check.why


async def test_removing_a_block_breaks_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w3")
    for i in range(4):
        await log.append(**fields(i))
    await store.delete(keys.audit_record("w3", 2))
    check = await log.verify()
    assert not check.ok and check.broken_at == 2


async def test_writers_keep_separate_streams(store: ObjectStore) -> None:
    a, b = ObjectAudit(store), ObjectAudit(store)
    await asyncio.gather(*(a.append(**fields(i)) for i in range(10)))
    await asyncio.gather(*(b.append(**fields(i)) for i in range(7)))
    checks = await a.verify_all()
    assert {s: c.records for s, c in checks.items()} == {a.stream: 10, b.stream: 7}
    assert all(c.ok for c in checks.values())


async def test_failed_write_fails_the_waiters_and_keeps_the_chain(store: ObjectStore) -> None:
    log = ObjectAudit(store, writer="w4")
    await log.append(**fields(0))
    await store.put(keys.audit_record("w4", 2), b"squatter")  # the next block is taken
    with pytest.raises(ObjectExists):
        await log.append(**fields(1))
    check = await log.verify()
    assert not check.ok and check.records == 1  # the squatter is visible as a break
