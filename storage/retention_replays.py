"""Retention of replay markers (``storage.retention``) that no inbox event names: found
through their due entries, oldest hour first, and deleted by their own stamp once past
the period and the windows; one pass over the markers themselves, made once per store,
for those stored before due entries existed."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

from storage import keys
from storage.inbox import replay_hour
from storage.listing import exists
from storage.retention_state import DELETES_AT_ONCE, RetentionState
from torpor.errors import (
    InvalidKey,
    ObjectExists,
)
from torpor.faults import CrashPoint, crash_point
from torpor.ports.repositories import RetentionReport

REPLAYS_PER_SWEEP = 256  # replay markers one sweep may delete (one read each)


class ReplaySweep(RetentionState):
    """The sweep of replay markers no inbox event names."""

    async def _sweep_replays(self, cutoff: datetime, report: RetentionReport) -> None:
        """Delete replay markers stamped before ``cutoff``, up to a page of them. A
        session's purge deletes the markers its inbox events name, but a request that
        stored nothing new (a duplicate resent signed afresh, a batch whose events all
        named no wait) is answered 2xx and remembered all the same, by a marker no event
        names. Past the retention period and the window no signature window is open for
        it. Unstamped markers (before stamps) are left to the purge.

        The markers are found through their due entries (``keys.replay_due``), oldest
        hour first, and the walk stops at the cutoff's hour: a sweep reads only markers
        it may delete (an hour late at most), and one with none due costs one listing.
        Round robin over the markers themselves, every sweep read a page of them for
        ever, the same young ones again and again."""
        if not await self._replays_listed():
            await self._list_replays(cutoff, report)
        last_hour = replay_hour(cutoff)
        page = await self.store.list(keys.REPLAYS_DUE, limit=REPLAYS_PER_SWEEP)
        due: list[tuple[str, str]] = []
        for key in page.keys:
            try:
                hour, source, content_digest = keys.replay_due_parts(key)
            except InvalidKey:
                continue  # not an entry of ours (a stray object): left for an operator
            if hour >= last_hour:
                break  # every entry after it is as young or younger
            due.append((key, keys.accepted_content(source, content_digest)))
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(entry: str, marker: str) -> int:
            async with gate:
                gone, _ = await self._delete_old_replay(marker, cutoff)
                crash_point(CrashPoint.REPLAY_MARKER_SWEPT)
                # After the marker: a crash between leaves the entry, which finds it again.
                await self.store.delete(entry)
                return gone + 1

        report.objects += sum(await asyncio.gather(*(one(e, m) for e, m in due)))

    async def _delete_old_replay(
        self, marker: str, cutoff: datetime
    ) -> tuple[int, datetime | None]:
        """Delete ``marker`` if it is stamped before ``cutoff``: (1 if it went, else 0;
        its stamp, None if it has none). Judged by its own stamp, not its entry's hour: a
        marker deleted (a purge) and written again by a later request has a younger
        stamp, and an entry of its own."""
        found = await self._stored(marker)
        # Gone: deleted with its session's inbox, or taken back by its request.
        at = None if found is None else _stamp(found.data)
        if found is None or at is None or at >= cutoff:
            return 0, at
        return int(await self.store.delete_if_match(marker, etag=found.etag)), at

    async def _replays_listed(self) -> bool:
        """Whether every marker stored before due entries existed has one by now."""
        if not self._replays_indexed:
            self._replays_indexed = await exists(self.store, keys.REPLAYS_LISTED)
        return self._replays_indexed

    async def _list_replays(self, cutoff: datetime, report: RetentionReport) -> None:
        """One pass over the markers themselves, a page a sweep, made once per store:
        a marker stored before due entries existed has none. One stamped before
        ``cutoff`` goes, any other stamped one is given its entry; the pass's end is
        recorded (``keys.REPLAYS_LISTED``). A process of an older version still writing
        markers after that leaves them to the purge (those its inbox events name)."""
        page = await self.store.list(
            keys.REPLAYS, start_after=self._replay_cursor, limit=REPLAYS_PER_SWEEP
        )
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(marker: str) -> int:
            try:
                source, content_digest = keys.accepted_content_parts(marker)
            except InvalidKey:
                return 0  # not a marker of ours (a stray object): left for an operator
            async with gate:
                gone, at = await self._delete_old_replay(marker, cutoff)
                if gone or at is None:
                    return gone  # gone, or unstamped: left to the purge, as before
                entry = keys.replay_due(replay_hour(at), source, content_digest)
                with contextlib.suppress(ObjectExists):  # written by its request already
                    await self.store.put_if_absent(entry, b"", durable=False)
                return 0

        report.objects += sum(await asyncio.gather(*(one(k) for k in page.keys)))
        self._replay_cursor = page.next_token
        if page.next_token is None:
            await self.store.put(keys.REPLAYS_LISTED, b"")
            self._replays_indexed = True


def _stamp(data: bytes) -> datetime | None:
    """A replay marker's stamp; None for one with none (b"accepted", written before
    stamps), or not ours to judge. Ours are aware (the index's clock): a naive one does
    not compare."""
    try:
        at = datetime.fromisoformat(data.decode())
    except ValueError:
        return None
    return at if at.tzinfo is not None else None
