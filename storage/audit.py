"""A tamper-evident audit log of every webhook decision, in the object store.

Each writer process owns one stream ``audit/{writer}/`` and appends *blocks*: create-only
objects ``{block:012d}`` holding consecutive records, every record carrying the hash of
the record before it. Editing, removing or reordering any record or block breaks the
chain at that point (``verify``).

Blocks are group commits: while one block is being written, new records queue up and go
into the next one, and each ``append`` returns only once its block is durable. A hash
chain is inherently serial, so one object per record would cap a replica at one object
store round trip per webhook; a block costs one round trip for everything that arrived
meanwhile. Writers never share a stream, so they never contend.

A block write whose outcome is unknown (the PUT landed, its answer was lost, the retry
met the object) must not wedge the writer: when the next block number is taken, the
writer reads what is there. If it is the continuation of its own chain (an earlier batch
that did land), it adopts it and writes on after it; if it is anything else, the chain
is broken at that block for all to see (``verify``), the waiters of that batch learn why,
and the writer moves past it. ``healthy`` says whether the last block write succeeded,
for the health route.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from storage import keys
from torpor.errors import ObjectExists
from torpor.ports import ObjectStore

GENESIS = "0" * 64
MAX_BLOCK_RECORDS = 512


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


def new_writer_id(now: datetime) -> str:
    """A stream name no other writer uses: start time, host, process, random."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:24] or "host"
    stamp = now.astimezone(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


class ObjectAudit:
    def __init__(self, store: ObjectStore, *, writer: str | None = None) -> None:
        self.store = store
        # Without a given name the stream is named at the first append, from its ``at``:
        # the caller's clock, not this module's.
        self._stream = writer
        self._queue: list[tuple[dict[str, Any], asyncio.Future[AuditRecord]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._seq, self._block, self._prev = 0, 0, GENESIS
        self.healthy = True  # False from a failed block write until the next one lands
        self.last_error: str | None = None

    @property
    def stream(self) -> str:
        if self._stream is None:
            raise RuntimeError("this audit writer has not written yet: its stream has no name")
        return self._stream

    async def append(
        self,
        *,
        verdict: str,
        at: datetime,
        source: str,
        body_sha256: str,
        event_id: str | None = None,
        session_id: str | None = None,
        correlation_id: str | None = None,
        signature: str | None = None,
        timestamp: datetime | None = None,
        trace_id: str | None = None,
    ) -> AuditRecord:
        """Returns once the record is durably in the store (its block is written)."""
        fields = {
            "verdict": verdict,
            "at": at,
            "source": source,
            "body_sha256": body_sha256,
            "event_id": event_id,
            "session_id": session_id,
            "correlation_id": correlation_id,
            "signature": signature,
            "timestamp": timestamp,
            "trace_id": trace_id,
        }
        if self._stream is None:
            self._stream = new_writer_id(at)
        future: asyncio.Future[AuditRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((fields, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:MAX_BLOCK_RECORDS], self._queue[MAX_BLOCK_RECORDS:]
            seq, prev, records = self._seq, self._prev, []
            for fields, _ in batch:
                seq += 1
                draft = AuditRecord(seq=seq, prev_hash=prev, **fields)
                record = draft.model_copy(update={"hash": draft.digest()})
                records.append(record)
                prev = record.hash
            data = "\n".join(r.model_dump_json() for r in records).encode()
            key = keys.audit_record(self.stream, self._block + 1)
            try:
                await self.store.put_if_absent(key, data)
            except ObjectExists as exc:
                found = await self._adopt(key)
                if found is True:  # our own earlier batch landed there: write on after it
                    self._queue = batch + self._queue
                    continue
                if found is False:  # a foreign block: the break stays visible; move past it
                    self._block += 1
                self._failed(batch, exc)
                continue
            except Exception as exc:  # outcome unknown: the next write finds out (_adopt)
                self._failed(batch, exc)
                continue
            self._block, self._seq, self._prev = self._block + 1, seq, prev
            self.healthy, self.last_error = True, None
            for (_, future), record in zip(batch, records, strict=True):
                if not future.done():
                    future.set_result(record)

    def _failed(
        self, batch: list[tuple[dict[str, Any], asyncio.Future[AuditRecord]]], exc: Exception
    ) -> None:
        self.healthy, self.last_error = False, f"{type(exc).__name__}: {exc}"[:300]
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def _adopt(self, key: str) -> bool | None:
        """If the block at ``key`` continues this writer's chain (a write whose answer was
        lost), take it as written and advance past it: True. False for anything else, None
        if it could not be read (the next write tries again)."""
        try:
            lines = (await self.store.get(key)).data.decode(errors="replace").splitlines()
            records = [AuditRecord.model_validate_json(line) for line in lines]
        except ValidationError:
            return False
        except Exception:  # the store failed again: decide on the next write
            return None
        seq, prev = self._seq, self._prev
        for record in records:
            if record.seq != seq + 1 or record.prev_hash != prev or record.digest() != record.hash:
                return False
            seq, prev = record.seq, record.hash
        if not records:
            return False
        self._block, self._seq, self._prev = self._block + 1, seq, prev
        return True

    async def close(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher

    async def streams(self) -> list[str]:
        """Every writer's stream in the store."""
        found: set[str] = set()
        token: str | None = None
        while True:
            page = await self.store.list(keys.AUDIT, start_after=token)
            found.update(k.split("/")[1] for k in page.keys)
            if page.next_token is None:
                return sorted(found)
            token = page.next_token

    async def verify(self, stream: str | None = None) -> ChainCheck:
        """Walk a stream (default: this writer's) and check every link."""
        if stream is None and self._stream is None:
            return ChainCheck(True, 0)  # nothing written yet
        stream = stream or self.stream
        prev, expected, count = GENESIS, 1, 0
        token: str | None = None
        block_no = 0
        while True:
            page = await self.store.list(keys.audit_prefix(stream), start_after=token)
            for key in page.keys:
                block_no += 1
                if key != keys.audit_record(stream, block_no):
                    return ChainCheck(False, count, expected, "a block is missing")
                for line in (await self.store.get(key)).data.decode(errors="replace").splitlines():
                    try:
                        record = AuditRecord.model_validate_json(line)
                    except ValidationError:
                        return ChainCheck(False, count, expected, "a record is unreadable")
                    if record.seq != expected:
                        return ChainCheck(False, count, expected, "a record is missing")
                    if record.prev_hash != prev:
                        return ChainCheck(False, count, record.seq, "the chain link does not match")
                    if record.digest() != record.hash:
                        return ChainCheck(False, count, record.seq, "the record was altered")
                    prev, expected, count = record.hash, expected + 1, count + 1
            if page.next_token is None:
                return ChainCheck(True, count)
            token = page.next_token

    async def verify_all(self) -> dict[str, ChainCheck]:
        return {stream: await self.verify(stream) for stream in await self.streams()}
