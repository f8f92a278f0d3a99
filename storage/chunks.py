"""History chunks: the sealed, immutable oldest part of a long session's lists.

A session's messages, tool log and processed event ids only ever grow. Rewriting all of
them at every commit makes a commit cost what the session's whole past costs, so the
oldest items are sealed, ``size`` at a time, into create-only objects named by session,
list, position and content digest (``storage.keys.chunk``). The snapshot keeps the
unsealed tail (at most ``2 * size - 1`` items per list) and the digests of its chunks.

Crash safety: chunks are written before the snapshot that names them. A crash or a lost
compare-and-swap in between leaves an orphan chunk that no snapshot names, which nothing
reads (it goes with the session when retention deletes ``chunks/{session}/``). A retry
seals the same items into the same key, and create-only finds it already there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import zlib
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from storage import keys
from torpor.awaiting import gathered
from torpor.errors import ObjectExists, ObjectNotFound, SnapshotCorrupt
from torpor.models import HistoryChunks, Message, SessionSnapshot, ToolLogEntry
from torpor.ports import ObjectStore

MAGIC = b"TPC1"
KINDS = ("messages", "tool_log", "processed_events")
DIGEST_CHARS = 12  # 48 bits of SHA-256 beside the position and session: the key names the content
READ_CONCURRENCY = 16


@dataclass(frozen=True, slots=True)
class SealedChunk:
    key: str
    data: bytes


def _items(snapshot: SessionSnapshot, kind: str) -> list[Any]:
    """A list's items as JSON-ready values, oldest first."""
    if kind == "messages":
        return [m.model_dump(mode="json") for m in snapshot.messages]
    if kind == "tool_log":
        return [[k, e.model_dump(mode="json")] for k, e in snapshot.tool_log.items()]
    return list(snapshot.processed_events)


def encode_chunk(items: list[Any]) -> bytes:
    return MAGIC + zlib.compress(json.dumps(items, separators=(",", ":")).encode(), 6)


def content_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def seal(snapshot: SessionSnapshot) -> tuple[SessionSnapshot, SessionSnapshot, list[SealedChunk]]:
    """Split ``snapshot`` (every item in memory) into what to store.

    Returns the whole snapshot with its chunk list brought up to date, the stored form
    (only the unsealed tails) and the chunks to write first. Pure: no I/O.
    """
    refs = snapshot.chunks
    size = refs.size
    new_refs: dict[str, list[str]] = {}
    tails: dict[str, int] = {}
    sealed: list[SealedChunk] = []
    lengths = {
        "messages": len(snapshot.messages),
        "tool_log": len(snapshot.tool_log),
        "processed_events": len(snapshot.processed_events),
    }
    for kind in KINDS:
        digests = list(getattr(refs, kind))
        done = len(digests) * size
        if lengths[kind] < done:
            # The lists are append-only; fewer items than were sealed means a caller
            # replaced a list it must only append to.
            raise ValueError(f"{kind} of {snapshot.session_id} shrank below its sealed chunks")
        if lengths[kind] - done >= 2 * size:
            items = _items(snapshot, kind)
            while lengths[kind] - done >= 2 * size:
                data = encode_chunk(items[done : done + size])
                digest = content_digest(data)
                sealed.append(
                    SealedChunk(keys.chunk(snapshot.session_id, kind, len(digests), digest), data)
                )
                digests.append(digest)
                done += size
        new_refs[kind] = digests
        tails[kind] = done
    chunks = HistoryChunks(size=size, **new_refs)
    whole = snapshot.model_copy(update={"chunks": chunks})
    tool_log = list(snapshot.tool_log.items())[tails["tool_log"] :]
    stored = whole.model_copy(
        update={
            "messages": snapshot.messages[tails["messages"] :],
            "tool_log": dict(tool_log),
            "processed_events": snapshot.processed_events[tails["processed_events"] :],
        }
    )
    return whole, stored, sealed


async def write(store: ObjectStore, sealed: list[SealedChunk]) -> None:
    """Create the chunks; one already there is this very content (its key says so)."""

    async def one(chunk: SealedChunk) -> None:
        # Already there: an earlier attempt of this commit wrote it (crash or lost swap).
        with contextlib.suppress(ObjectExists):
            await store.put_if_absent(chunk.key, chunk.data)

    await gathered(*(one(c) for c in sealed))


async def restore(
    store: ObjectStore, stored: SessionSnapshot, *, kinds: tuple[str, ...] = KINDS
) -> SessionSnapshot:
    """The whole snapshot: its chunks' items in front of the stored tails (of ``kinds``
    only; the others' tails stay as stored)."""
    refs = stored.chunks
    if not any(getattr(refs, kind) for kind in kinds):
        return stored  # a young session, or one stored before chunks existed
    gate = asyncio.Semaphore(READ_CONCURRENCY)
    sid = stored.session_id

    async def one(kind: str, seq: int, digest: str) -> list[Any]:
        key = keys.chunk(sid, kind, seq, digest)
        async with gate:
            try:
                obj = await store.get(key)
            except ObjectNotFound:
                raise SnapshotCorrupt(
                    f"snapshot of {sid}: history chunk {key} is missing"
                ) from None
        return _decode(obj.data, digest, size=refs.size, what=key)

    update: dict[str, Any] = {}
    for kind in kinds:
        digests: list[str] = getattr(refs, kind)
        if not digests:
            continue
        parts = await asyncio.gather(*(one(kind, i, d) for i, d in enumerate(digests)))
        items = [item for part in parts for item in part]
        try:
            if kind == "messages":
                update[kind] = [Message.model_validate(m) for m in items] + stored.messages
            elif kind == "tool_log":
                older = {k: ToolLogEntry.model_validate(e) for k, e in items}
                update[kind] = {**older, **stored.tool_log}
            else:
                update[kind] = [str(e) for e in items] + stored.processed_events
        except (ValidationError, ValueError, TypeError) as exc:
            raise SnapshotCorrupt(f"snapshot of {sid}: a {kind} chunk is invalid") from exc
    return stored.model_copy(update=update)


def _decode(data: bytes, digest: str, *, size: int, what: str) -> list[Any]:
    if content_digest(data) != digest:
        raise SnapshotCorrupt(f"{what}: content does not match its digest")
    try:
        items = json.loads(zlib.decompress(data[len(MAGIC) :]))
    except (zlib.error, ValueError) as exc:
        raise SnapshotCorrupt(f"{what}: does not decompress or parse") from exc
    if not data.startswith(MAGIC) or not isinstance(items, list) or len(items) != size:
        raise SnapshotCorrupt(f"{what}: not a chunk of {size} items")
    return items
