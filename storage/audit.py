"""A tamper-evident audit log of every webhook decision, in the object store.

Each record is a create-only object ``audit/{stream}/{seq:012d}`` holding the hash of the
record before it, so deleting, reordering or editing any record breaks the chain at that
point (``verify``). Several writers (Serve replicas) may append to one stream: each
claims ``seq`` with a create-only write, and a writer that loses re-reads the head and
tries the next number. A ``HEAD`` hint object spares a new writer from listing the whole
stream; it is only a hint, the records themselves are the truth.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from storage import keys
from torpor.errors import ObjectExists, ObjectNotFound, StorageUnavailable
from torpor.ports import ObjectStore

GENESIS = "0" * 64
MAX_APPEND_ATTEMPTS = 50


class AuditRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seq: int
    prev_hash: str
    at: datetime
    source: str
    verdict: str  # accepted, duplicate, unknown, rejected:<reason>
    event_id: str | None = None
    session_id: str | None = None
    correlation_id: str | None = None
    body_sha256: str
    signature: str | None = None
    timestamp: datetime | None = None
    trace_id: str | None = None
    hash: str = ""

    def digest(self) -> str:
        body = self.model_dump(mode="json", exclude={"hash"})
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ChainCheck:
    ok: bool
    records: int
    broken_at: int | None = None
    why: str = ""


class AuditLog:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._heads: dict[str, tuple[int, str]] = {}

    async def append(self, stream: str, **fields: Any) -> AuditRecord:
        seq, prev = await self._head(stream)
        for _ in range(MAX_APPEND_ATTEMPTS):
            draft = AuditRecord(seq=seq + 1, prev_hash=prev, **fields)
            record = draft.model_copy(update={"hash": draft.digest()})
            try:
                await self.store.put_if_absent(
                    keys.audit_record(stream, record.seq), record.model_dump_json().encode()
                )
            except ObjectExists:
                # Another writer took this number: move to the true head and try again.
                seq, prev = await self._probe(stream, seq + 1)
                continue
            self._heads[stream] = (record.seq, record.hash)
            if record.seq % 64 == 0:
                await self.store.put(
                    keys.audit_head(stream),
                    json.dumps({"seq": record.seq, "hash": record.hash}).encode(),
                )
            return record
        raise StorageUnavailable(f"audit stream {stream} is too contended to append to")

    async def _head(self, stream: str) -> tuple[int, str]:
        if stream in self._heads:
            return self._heads[stream]
        start, prev = 0, GENESIS
        try:
            hint = json.loads((await self.store.get(keys.audit_head(stream))).data)
            start, prev = int(hint["seq"]), str(hint["hash"])
        except (ObjectNotFound, ValueError, KeyError, TypeError):
            pass
        return await self._probe(stream, start + 1, fallback=(start, prev))

    async def _probe(
        self, stream: str, seq: int, fallback: tuple[int, str] | None = None
    ) -> tuple[int, str]:
        """Walk forward from ``seq`` to the last existing record."""
        last = fallback
        while True:
            try:
                obj = await self.store.get(keys.audit_record(stream, seq))
            except ObjectNotFound:
                break
            record = AuditRecord.model_validate_json(obj.data)
            last = (record.seq, record.hash)
            seq += 1
        if last is None:
            previous = await self.store.get(keys.audit_record(stream, seq - 1))
            record = AuditRecord.model_validate_json(previous.data)
            last = (record.seq, record.hash)
        self._heads[stream] = last
        return last

    async def verify(self, stream: str) -> ChainCheck:
        """Walk the whole stream and check every link."""
        prev, expected_seq, count = GENESIS, 1, 0
        token: str | None = None
        prefix = keys.audit_prefix(stream)
        while True:
            page = await self.store.list(prefix, start_after=token)
            for key in page.keys:
                if key.endswith("/HEAD"):
                    continue
                record = AuditRecord.model_validate_json((await self.store.get(key)).data)
                if record.seq != expected_seq:
                    return ChainCheck(False, count, expected_seq, "a record is missing")
                if record.prev_hash != prev:
                    return ChainCheck(False, count, record.seq, "the chain link does not match")
                if record.digest() != record.hash:
                    return ChainCheck(False, count, record.seq, "the record was altered")
                prev, expected_seq, count = record.hash, expected_seq + 1, count + 1
            if page.next_token is None:
                return ChainCheck(True, count)
            token = page.next_token
