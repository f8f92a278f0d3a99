"""Audit archives: a stream's old blocks compacted into one object, chain intact.

A busy writer leaves thousands of small block objects. Compaction copies a run of them,
verbatim and in order, into one create-only archive ``audit-archives/{stream}/
{first:012d}-{last:012d}`` and only then deletes them, so a crash in between leaves both
(``ObjectAudit.verify`` reads the archive and skips the leftover blocks, and the next
compaction deletes them). The records and their hash links are unchanged, so the chain
still verifies end to end, and the checkpoints still vouch for the heads of archived
blocks: removing an archive is a missing block, like removing a block (unless an
overlapping archive, written by a concurrent compaction, holds the same blocks).

The newest ``KEEP_BLOCKS`` blocks of a stream are left as they are while it is written
(the operator console reads a stream's newest blocks, ``ObjectAudit.recent``), and
fewer than ``MIN_BLOCKS`` waiting are not worth an archive yet. A stream whose newest
record is older than the caller's ``quiet_before`` is compacted whole, however few its
blocks: each writer process has a stream of its own, so every process that ever ran
(each replica started, each restart) left one, and one that wrote fewer blocks than the
two thresholds together stayed as loose blocks for ever. That is safe for a writer that
is only quiet, too: a writer reads only the block after its own head (a write whose
answer was lost), never the blocks before it, and the chain goes on from the archive.
"""

from __future__ import annotations

import contextlib
import json
import sys
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from storage import keys
from torpor.errors import ObjectExists, ObjectNotFound
from torpor.ports import ObjectStore

ARCHIVES = "audit-archives/"
KEEP_BLOCKS = 4  # the newest blocks of a stream stay as they are
MIN_BLOCKS = 16  # fewer than this waiting: not worth an archive yet
MAX_BLOCKS = 512  # blocks per archive
# No record for this long: the stream is compacted whole (its writer is gone, or idle).
QUIET = timedelta(days=1)


def archives_prefix(stream: str) -> str:
    return f"{ARCHIVES}{keys.safe(stream, 'audit stream')}/"


def archive_key(stream: str, first: int, last: int) -> str:
    return f"{archives_prefix(stream)}{first:012d}-{last:012d}"


@dataclass(frozen=True)
class Archive:
    key: str
    first: int
    last: int

    @classmethod
    def parse(cls, key: str) -> Archive | None:
        first, _, last = key.rsplit("/", 1)[-1].partition("-")
        if not (first.isdigit() and last.isdigit()) or int(first) > int(last):
            return None
        return cls(key, int(first), int(last))


# Blocks are copied byte for byte, whatever they hold: one that is not UTF-8 (tampered,
# or rotten on disk) is evidence ``verify`` reports as a broken chain, and compaction is
# no judge of it. Decoded strictly, such a block raised at every visit of its stream, and
# the retention sweep it runs in stopped there, every sweep: no session was purged again.
# Its stray bytes travel as lone surrogates (\udc80-\udcff, JSON-escaped); a block that is
# UTF-8, which every block a writer makes is, encodes as before.
BYTES = "surrogateescape"


def encode(blocks: list[bytes]) -> bytes:
    return zlib.compress(json.dumps([b.decode("utf-8", BYTES) for b in blocks]).encode(), 6)


def decode(data: bytes) -> list[bytes] | None:
    """The archived blocks, or None if the archive is damaged."""
    try:
        blocks = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError):
        return None
    if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
        return None
    try:
        return [b.encode("utf-8", BYTES) for b in blocks]
    except UnicodeEncodeError:  # a surrogate no encode writes: forged, not a copy
        return None


async def all_keys(store: ObjectStore, prefix: str, start_after: str | None = None) -> list[str]:
    found: list[str] = []
    token = start_after
    while True:
        page = await store.list(prefix, start_after=token)
        found += page.keys
        if page.next_token is None:
            return found
        token = page.next_token


async def archives(store: ObjectStore, stream: str) -> list[Archive]:
    found = [Archive.parse(k) for k in await all_keys(store, archives_prefix(stream))]
    return [a for a in found if a is not None]


def _block_of(key: str) -> int:
    """The block number a key under a stream's prefix names; past every block for a key
    that names none (a stray object, a store's "folder" marker): it is left alone."""
    number = keys.audit_block_number(key)
    return sys.maxsize if number is None else number


async def compact(store: ObjectStore, stream: str, *, quiet_before: datetime | None = None) -> int:
    """Archive one run of ``stream``'s old blocks; returns how many blocks it archived.
    A stream whose newest record was written before ``quiet_before`` gives all its
    blocks, however few (without it, a stream's newest and a short run stay).

    Two compactions of a stream at once (two reconcilers overlapping in a restart) may
    both start after the same archive and end at different blocks (the later listing saw
    more): their archives then overlap, each a verbatim copy of the same create-only
    blocks, and ``ObjectAudit.verify`` takes each block once. Every archive starts right
    after one that was there (or at block 1), so together they never leave a gap."""
    done = await archives(store, stream)
    archived = max((a.last for a in done), default=0)
    # Finish an interrupted compaction: blocks an archive already holds go first. They
    # sort first, so a page at a time up to the first block past them: listed whole, a
    # stream far behind (a busy writer, one from before archives) cost every visit a
    # listing of its whole backlog while each archived one run of it.
    token: str | None = None
    while archived:
        page = await store.list(keys.audit_prefix(stream), start_after=token, limit=MAX_BLOCKS)
        held = [k for k in page.keys if _block_of(k) <= archived]
        for key in held:
            await store.delete(key)
        if len(held) < len(page.keys) or page.next_token is None:
            break
        token = page.next_token
    page = await store.list(
        keys.audit_prefix(stream),
        start_after=keys.audit_record(stream, archived) if archived else None,
        limit=MAX_BLOCKS + KEEP_BLOCKS,
    )
    run = _run(stream, archived, page.keys[: max(0, len(page.keys) - KEEP_BLOCKS)])
    if len(run) < MIN_BLOCKS:
        # Only then: a stream with a run to archive anyway costs no read of its head.
        if page.next_token is not None or not await _quiet(store, page.keys, quiet_before):
            return 0
        run = _run(stream, archived, page.keys)
        if not run:
            return 0
    try:
        blocks = [(await store.get(key)).data for key in run]
    except ObjectNotFound:  # another compaction archived them since the listing
        return 0
    target = archive_key(stream, archived + 1, archived + len(run))
    with contextlib.suppress(ObjectExists):  # an earlier attempt wrote this very run
        await store.put_if_absent(target, encode(blocks))
    for key in run:
        await store.delete(key)
    return len(run)


def _run(stream: str, archived: int, listed: list[str]) -> list[str]:
    """The blocks of ``listed`` that follow block ``archived`` one after another."""
    run: list[str] = []
    for key in listed:
        if key != keys.audit_record(stream, archived + len(run) + 1):
            break  # a gap: verify reports it; an archive never papers over one
        run.append(key)
    return run


async def _quiet(store: ObjectStore, listed: list[str], quiet_before: datetime | None) -> bool:
    """Whether the newest block of ``listed`` (a stream's last blocks, all of them) ends
    with a record written before ``quiet_before``. A block that cannot be read so (gone
    since the listing, tampered) is no quiet stream's: it waits for more blocks."""
    numbered = [k for k in listed if keys.audit_block_number(k) is not None]
    if quiet_before is None or not numbered:
        return False
    try:
        lines = (await store.get(numbered[-1])).data.decode(errors="replace").splitlines()
        at = datetime.fromisoformat(json.loads(lines[-1])["at"])
    except (ObjectNotFound, IndexError, ValueError, KeyError, TypeError):
        return False
    # Records are stamped aware (the gateway's clock); a naive one does not compare.
    return at.tzinfo is not None and at < quiet_before
