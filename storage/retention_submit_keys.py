"""Retention of submit-key records (``storage.retention``) whose session was never made:
a page of them visited a sweep, a pass over them all at most once an hour."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from storage import keys, submit_keys
from storage.retention_state import DELETES_AT_ONCE, RetentionState
from torpor.errors import (
    InvalidKey,
    SessionNotFound,
    SnapshotError,
)
from torpor.ports.repositories import RetentionReport

SUBMIT_KEYS_PER_SWEEP = 256  # submit-key records one sweep looks at (one read each)
# A pass over every submit-key record starts at most this often. A record goes only a
# retention period and a window after it was written, so an hour's wait delays no
# deletion by much, and a deployment with many records is not read a page every sweep
# (every 5 s) for ever.
SUBMIT_KEYS_PASS_EVERY = timedelta(hours=1)


class SubmitKeySweep(RetentionState):
    """The sweep of submit-key records left by a create that failed."""

    async def _sweep_submit_keys(
        self, cutoff: datetime, report: RetentionReport, *, now: datetime
    ) -> None:
        """Visit a page of submit-key records (round robin, a pass over them all at most
        once per ``SUBMIT_KEYS_PASS_EVERY``) and delete those written before ``cutoff``
        whose session was never made: the record is written before the session, so a
        create that failed (an outage) and that no retry of the key took over left it,
        and its ref, naming a session no purge would ever visit. A record whose session
        exists goes with it (``_records``)."""
        if self._submit_cursor is None:
            if self._submit_pass_after is not None and now < self._submit_pass_after:
                return
            self._submit_pass_after = now + SUBMIT_KEYS_PASS_EVERY
        page = await self.store.list(
            keys.SUBMIT_KEYS, start_after=self._submit_cursor, limit=SUBMIT_KEYS_PER_SWEEP
        )
        self._submit_cursor = page.next_token
        gate = asyncio.Semaphore(DELETES_AT_ONCE)

        async def one(key: str) -> int:
            try:
                tenant, hashed = keys.submit_key_parts(key)
            except InvalidKey:
                return 0  # not a record of ours (a stray object): left for an operator
            async with gate:
                found = await self._stored(key)
                if found is None:
                    return 0
                try:
                    record = submit_keys.decode(found.data)
                except (ValueError, KeyError, TypeError, InvalidKey):
                    return 0  # unreadable: left for an operator, as other records are
                at = record.created_at
                if at.tzinfo is None or at > cutoff:
                    return 0  # its request may still make the session
                try:
                    await self.snapshots.header(record.session_id)
                    return 0
                except SessionNotFound:
                    pass
                except (SnapshotError, InvalidKey):
                    return 0  # stored, if unreadable: an operator looks first
                await self.store.delete(keys.submit_key_ref(record.session_id, tenant, hashed))
                # Conditional: a later request may take the key over (its 24 h are long
                # past) for a session it is making right now.
                return 1 + await self.store.delete_if_match(key, etag=found.etag)

        report.objects += sum(await asyncio.gather(*(one(k) for k in page.keys)))
