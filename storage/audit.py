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

Hash chains show edits but not a cut at the end: deleting the last block, or a whole
stream, leaves a shorter chain that is still valid. Two more kinds of object close that
gap. A create-only *manifest* marker ``audit-manifest/{writer}`` is written before a
stream's first block, so a stream deleted whole is still named. Every
``checkpoint_every`` blocks (and on ``close``) a create-only *checkpoint*
``audit-checkpoints/{writer}/{block}`` records the stream's head (block, seq, hash),
signed with HMAC-SHA256 under the configured audit key; ``verify`` then demands that
block and head. Without a key a checkpoint carries a plain SHA-256 (it catches deletion,
not a forger who rewrites the checkpoint too) and ``verify`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from storage import audit_archive, keys
from storage.listing import all_keys
from torpor.errors import ObjectExists, ObjectNotFound, StorageUnavailable
from torpor.ports import ObjectStore

GENESIS = "0" * 64
MAX_BLOCK_RECORDS = 512
MANIFEST = "audit-manifest/"
CHECKPOINTS = "audit-checkpoints/"
CHECKPOINT_EVERY = 16
MISSING = "a block is missing"
# Walks of one verify at most: a compaction overlapping a walk sends it round again
# (``verify``); a gap still there after this many is reported.
WALKS = 3


def manifest_key(stream: str) -> str:
    return f"{MANIFEST}{keys.safe(stream, 'audit stream')}"


def checkpoints_prefix(stream: str) -> str:
    return f"{CHECKPOINTS}{keys.safe(stream, 'audit stream')}/"


def checkpoint_key(stream: str, block: int) -> str:
    return f"{checkpoints_prefix(stream)}{block:012d}"


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
    trace_id: str | None = None  # the sender's (its ``traceparent``)
    # The trace of the session the webhook was routed to: what links it to the reasoning
    # it caused. Left out of the digest while unset, so records written before it existed
    # still verify.
    session_trace_id: str | None = None
    hash: str = ""

    def digest(self) -> str:
        unset = {"session_trace_id"} if self.session_trace_id is None else set()
        body = self.model_dump(mode="json", exclude={"hash", *unset})
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class ChainCheck:
    ok: bool
    records: int
    broken_at: int | None = None
    why: str = ""
    # How the head was vouched for: "signed", "unsigned (no audit key)",
    # "signed, not checked (no audit key here)" or "none" (no checkpoint yet).
    checkpoints: str = "none"


class Checkpoint(BaseModel):
    """A stream's head at one block: what a later truncation would have to remove."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: str
    block: int
    seq: int
    head: str
    mac: str | None = None  # HMAC-SHA256 under the audit key
    sha256: str | None = None  # without a key: a plain digest (catches loss, not forgery)

    def payload(self) -> bytes:
        return f"{self.stream}\n{self.block}\n{self.seq}\n{self.head}".encode()

    @classmethod
    def make(cls, stream: str, block: int, seq: int, head: str, key: bytes | None) -> Checkpoint:
        draft = cls(stream=stream, block=block, seq=seq, head=head)
        if key is None:
            return draft.model_copy(update={"sha256": hashlib.sha256(draft.payload()).hexdigest()})
        mac = hmac.new(key, draft.payload(), hashlib.sha256).hexdigest()
        return draft.model_copy(update={"mac": mac})

    def vouched(self, key: bytes | None) -> str | None:
        """How this checkpoint is vouched for, or None if it does not check out."""
        if self.mac is not None:
            if key is None:
                return "signed, not checked (no audit key here)"
            good = hmac.new(key, self.payload(), hashlib.sha256).hexdigest()
            return "signed" if hmac.compare_digest(good, self.mac) else None
        if self.sha256 != hashlib.sha256(self.payload()).hexdigest():
            return None
        return "unsigned (no audit key)"


def new_writer_id(now: datetime) -> str:
    """A stream name no other writer uses: start time, host, process, random."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:24] or "host"
    stamp = now.astimezone(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{host}-{os.getpid()}-{secrets.token_hex(3)}"


class _Chain:
    """The walk along one stream's records, block after block."""

    def __init__(self, heads: dict[int, tuple[int, str]]) -> None:
        self.heads = heads
        self.prev, self.expected, self.count, self.block = GENESIS, 1, 0, 0

    def broken(self, why: str, at: int | None = None) -> ChainCheck:
        return ChainCheck(False, self.count, self.expected if at is None else at, why)

    def take(self, data: bytes) -> ChainCheck | None:
        """Check one block's records; a ``ChainCheck`` saying where it broke, or None."""
        for line in data.decode(errors="replace").splitlines():
            try:
                record = AuditRecord.model_validate_json(line)
            except ValidationError:
                return self.broken("a record is unreadable")
            if record.seq != self.expected:
                return self.broken("a record is missing")
            if record.prev_hash != self.prev:
                return self.broken("the chain link does not match", record.seq)
            if record.digest() != record.hash:
                return self.broken("the record was altered", record.seq)
            self.prev, self.expected, self.count = record.hash, self.expected + 1, self.count + 1
        self.block += 1
        self.heads[self.block] = (self.expected - 1, self.prev)
        return None

    def again(self, block: int, data: bytes) -> ChainCheck | None:
        """Check a block taken already, as a second archive holds it (two compactions
        overlapped): it must end at the same record, or the copies disagree."""
        lines = data.decode(errors="replace").splitlines()
        try:
            last = AuditRecord.model_validate_json(lines[-1]) if lines else None
        except ValidationError:
            last = None
        head = self.heads.get(block)
        if last is None or last.digest() != last.hash or head != (last.seq, last.hash):
            return self.broken("two archives disagree", head[0] if head else None)
        return None


class ObjectAudit:
    def __init__(
        self,
        store: ObjectStore,
        *,
        writer: str | None = None,
        key: str | None = None,
        checkpoint_every: int = CHECKPOINT_EVERY,
    ) -> None:
        self.store = store
        self._key = key.encode() if key else None
        self._checkpoint_every = max(1, checkpoint_every)
        self._manifested = False
        self._checkpointed = 0  # the last block a checkpoint vouches for
        # Without a given name the stream is named at the first append, from its ``at``:
        # the caller's clock, not this module's.
        self._stream = writer
        self._queue: list[tuple[dict[str, Any], asyncio.Future[AuditRecord]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._writing: list[tuple[dict[str, Any], asyncio.Future[AuditRecord]]] = []  # a block
        # The block written whose callers are not told yet (a checkpoint is due first).
        self._landed: list[tuple[tuple[dict[str, Any], asyncio.Future[AuditRecord]], AuditRecord]]
        self._landed = []
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
        session_trace_id: str | None = None,
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
            "session_trace_id": session_trace_id,
        }
        if self._stream is None:
            self._stream = new_writer_id(at)
        future: asyncio.Future[AuditRecord] = asyncio.get_running_loop().create_future()
        self._queue.append((fields, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = flusher = asyncio.create_task(self._flush())
            flusher.add_done_callback(self._flusher_ended)
        return await future

    def _flusher_ended(self, flusher: asyncio.Task[None]) -> None:
        """A flusher cancelled before its first step (its loop shutting down) ran none of
        ``_flush``'s own answer to a cancel, and one that raised (a bug: store failures
        are each batch's own) left its callers too: they are answered here. Only while no
        newer flusher has started, which writes what is queued itself."""
        if flusher is not self._flusher:
            return
        if flusher.cancelled():
            self._answer_all(StorageUnavailable("the audit write was cancelled"))
        elif (raised := flusher.exception()) is not None:
            failure = raised if isinstance(raised, Exception) else RuntimeError(repr(raised))
            self._answer_all(failure)

    async def _flush(self) -> None:
        try:
            await self._write_queued()
        except asyncio.CancelledError:
            # Cancelled under a write (the loop or the store closing): every caller still
            # waiting is answered, not left on a future no flush would settle.
            self._answer_all(StorageUnavailable("the audit write was cancelled"))
            raise

    def _answer_all(self, failure: Exception) -> None:
        """Every caller of a flush that ends early. A block already written answers its
        callers with their records (a checkpoint after it was cancelled); one in flight
        is unknown, as after any failed write (the next write finds out), and those
        queued behind it were never tried: both get ``failure``."""
        for (_, future), record in self._landed:
            if not future.done():
                future.set_result(record)
        waiting, self._writing, self._queue = [*self._writing, *self._queue], [], []
        self._landed = []
        if waiting:
            self._failed(waiting, failure)

    async def _write_queued(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:MAX_BLOCK_RECORDS], self._queue[MAX_BLOCK_RECORDS:]
            self._writing = batch
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
                await self._manifest()
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
            self._writing, self._landed = [], list(zip(batch, records, strict=True))
            if self._block - self._checkpointed >= self._checkpoint_every:
                # Before the callers hear back: a block whose append returned is vouched
                # for whenever a checkpoint was due (one more write every N blocks).
                await self._checkpoint()
            for (_, future), record in self._landed:
                if not future.done():
                    future.set_result(record)
            self._landed = []

    async def _manifest(self) -> None:
        """Name the stream before its first block, so deleting it whole shows."""
        if self._manifested:
            return
        with contextlib.suppress(ObjectExists):  # an earlier attempt of ours landed
            await self.store.put_if_absent(manifest_key(self.stream), b"")
        self._manifested = True

    async def _checkpoint(self) -> None:
        """Vouch for the head; records are already durable, so a failure only delays it."""
        if self._block <= self._checkpointed:
            return
        mark = Checkpoint.make(self.stream, self._block, self._seq, self._prev, self._key)
        try:
            await self.store.put_if_absent(
                checkpoint_key(self.stream, self._block), mark.model_dump_json().encode()
            )
        except ObjectExists:
            pass  # our own earlier write whose answer was lost
        except Exception:
            return  # the next block tries again
        self._checkpointed = self._block

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
        flusher = self._flusher
        # A flush begun on another loop (services closed on a loop of their own) cannot
        # be waited for from this one, and is not, as before.
        if flusher is not None and flusher.get_loop() is asyncio.get_running_loop():
            # Waited for, not awaited: a flush that failed or was cancelled has answered
            # its callers (``_flush``), and its end is no error of the closing caller's;
            # a cancel of the caller itself still comes through ``wait``.
            await asyncio.wait([flusher])
            if not flusher.cancelled():
                flusher.exception()  # seen: its callers were answered with it
        if self._stream is not None:
            await self._checkpoint()

    async def _keys(self, prefix: str) -> list[str]:
        return await all_keys(self.store, prefix)

    async def streams(self) -> list[str]:
        """Every writer's stream in the store, and every one the manifest names."""
        found = {k.split("/")[1] for k in await self._keys(keys.AUDIT)}
        found.update(k.split("/")[1] for k in await self._keys(audit_archive.ARCHIVES))
        found.update(k.removeprefix(MANIFEST) for k in await self._keys(MANIFEST))
        return sorted(found)

    async def verify(self, stream: str | None = None) -> ChainCheck:
        """Walk a stream (default: this writer's) and check every link."""
        if stream is None and self._stream is None:
            return ChainCheck(True, 0)  # nothing written yet
        stream = stream or self.stream
        for _ in range(WALKS):
            heads: dict[int, tuple[int, str]] = {}
            archived = await audit_archive.archives(self.store, stream)
            check = await self._walk(stream, heads, archived)
            # A compaction (the reconciler's) between the walk's listing of the archives
            # and its reads of the blocks archived and deleted blocks the walk still
            # expected: a gap only if the archives did not move meanwhile.
            if check.ok or check.why != MISSING:
                break
            if await audit_archive.archives(self.store, stream) == archived:
                break
        if not check.ok:
            return check
        return await self._against_checkpoints(stream, check, heads)

    async def _against_checkpoints(
        self, stream: str, check: ChainCheck, heads: dict[int, tuple[int, str]]
    ) -> ChainCheck:
        """A valid chain may still be cut short: hold it to the manifest and checkpoints."""
        if not heads and manifest_key(stream) in await self._keys(manifest_key(stream)):
            why = "truncated: the manifest names this stream, it has no block"
            return ChainCheck(False, 0, 1, why)
        vouched = "none"
        for key in await self._keys(checkpoints_prefix(stream)):
            try:
                mark = Checkpoint.model_validate_json((await self.store.get(key)).data)
            except ValidationError:
                return ChainCheck(False, check.records, None, "a checkpoint is unreadable")
            how = mark.vouched(self._key)
            if how is None or mark.stream != stream or key != checkpoint_key(stream, mark.block):
                why = "a checkpoint was forged or altered"
                return ChainCheck(False, check.records, mark.seq, why)
            if mark.block not in heads:
                why = f"truncated: block {mark.block} is missing after a checkpoint"
                return ChainCheck(False, check.records, mark.seq, why, how)
            if heads[mark.block] != (mark.seq, mark.head):
                why = "a checkpoint does not match the chain"
                return ChainCheck(False, check.records, mark.seq, why, how)
            vouched = how
        return ChainCheck(True, check.records, checkpoints=vouched)

    async def _walk(
        self,
        stream: str,
        heads: dict[int, tuple[int, str]],
        archived: list[audit_archive.Archive],
    ) -> ChainCheck:
        """Check every link of ``stream``, its ``archived`` archives first, then its
        blocks; ``heads`` gets each block's last (seq, hash)."""
        chain = _Chain(heads)
        for archive in archived:
            # Archives may overlap (two compactions at once, ``audit_archive.compact``):
            # one must start at or before the next block, and the blocks an earlier one
            # gave are only checked to be the same again.
            if archive.first > chain.block + 1:
                return chain.broken(MISSING)
            blocks = audit_archive.decode((await self.store.get(archive.key)).data)
            if blocks is None or len(blocks) != archive.last - archive.first + 1:
                return chain.broken("an archive is unreadable")
            for number, data in enumerate(blocks, start=archive.first):
                repeated = number <= chain.block
                broken = chain.again(number, data) if repeated else chain.take(data)
                if broken is not None:
                    return broken
        # Blocks an archive already holds (a compaction that stopped short) are skipped.
        token = keys.audit_record(stream, chain.block) if chain.block else None
        while True:
            page = await self.store.list(keys.audit_prefix(stream), start_after=token)
            for key in page.keys:
                if keys.audit_block_number(key) is None:
                    # No block (a folder marker, a stray object), as compaction leaves it:
                    # taken for the next block, it read as one missing, and the chain as
                    # broken for good. A block that is missing still shows: the next
                    # numbered key is not the one expected.
                    continue
                if key != keys.audit_record(stream, chain.block + 1):
                    return chain.broken(MISSING)
                try:
                    data = (await self.store.get(key)).data
                except ObjectNotFound:  # listed, then archived (or removed): ``verify`` judges
                    return chain.broken(MISSING)
                if (broken := chain.take(data)) is not None:
                    return broken
            if page.next_token is None:
                return ChainCheck(True, chain.count)
            token = page.next_token

    async def recent(self, *, blocks: int = 8) -> list[AuditRecord]:
        """The records of the last ``blocks`` blocks of every stream, oldest first: what
        the operator console shows (it reads, it does not verify: ``verify`` does)."""
        found: list[AuditRecord] = []
        for stream in await self.streams():
            listed = await self._keys(keys.audit_prefix(stream))
            numbered = [k for k in listed if keys.audit_block_number(k) is not None]
            for key in numbered[-blocks:]:
                try:
                    data = (await self.store.get(key)).data
                except ObjectNotFound:  # archived since the listing (a compaction ran)
                    continue
                for line in data.decode(errors="replace").splitlines():
                    with contextlib.suppress(ValidationError):
                        found.append(AuditRecord.model_validate_json(line))
        return sorted(found, key=lambda r: r.at)

    async def verify_all(self) -> dict[str, ChainCheck]:
        return {stream: await self.verify(stream) for stream in await self.streams()}
