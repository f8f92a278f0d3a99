"""Each session's inbox: one create-only object per delivered event.

The key is the session plus H(source, event id), so a redelivery by a sender, a retry by
the ingress or a second poll that finds the same outcome all land on the same object and
are no-ops. The inbox is written before any activation is attempted, so an event that
arrives while its session is running, or before its wait is committed, is never lost: it
waits here until an activation reads it.

Beside it, the replay markers of accepted requests (``remember_accepted``). A marker
that no inbox event names is also listed under the hour it was stamped
(``keys.replay_due``), which is how retention finds it once it may go: oldest hour
first, never the ones not yet due. One that an event names goes with its session.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from datetime import UTC, datetime

from pydantic import ValidationError

from storage import keys
from torpor.awaiting import gathered
from torpor.errors import ObjectExists, ObjectNotFound
from torpor.events import InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ports import ObjectStore, StagesCreates, Stored, already_durable


def replay_hour(at: datetime) -> str:
    """The hour a replay marker stamped ``at`` is listed under (``keys.replay_due``)."""
    return at.astimezone(UTC).strftime("%Y%m%d%H")


class ObjectInbox:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        # Known once: a runtime protocol check costs microseconds on every webhook.
        self._staging = store if isinstance(store, StagesCreates) else None

    async def deliver(self, event: InboxEvent) -> bool:
        key = keys.inbox_event(event.session_id, event.key)
        try:
            await self.store.put_if_absent(key, event.model_dump_json().encode())
        except ObjectExists:
            return False
        return True

    async def stage(self, event: InboxEvent) -> Stored:
        key = keys.inbox_event(event.session_id, event.key)
        data = event.model_dump_json().encode()
        try:
            if self._staging is not None:
                return Stored(True, (await self._staging.stage_if_absent(key, data)).durable)
            await self.store.put_if_absent(key, data)
        except ObjectExists:
            return Stored(False, already_durable)
        return Stored(True, already_durable)

    async def pending(self, session_id: str, *, processed: Collection[str]) -> list[InboxEvent]:
        prefix = keys.inbox_prefix(session_id)
        names: list[str] = []
        token: str | None = None
        while True:
            page = await self.store.list(prefix, start_after=token)
            names.extend(k for k in page.keys if k[len(prefix) :] not in processed)
            if page.next_token is None:
                break
            token = page.next_token
        events = await gathered(*(self._read(name) for name in names))
        found = [e for e in events if e is not None]
        return sorted(found, key=lambda e: (e.received_at, e.key))

    async def find(self, session_id: str, event_key: str) -> InboxEvent | None:
        return await self._read(keys.inbox_event(session_id, event_key))

    async def remember_accepted(
        self,
        *,
        source: str,
        content_digest: str,
        at: datetime | None = None,
        in_inbox: bool = False,
    ) -> bool:
        # Not flushed to disk on its own (``durable=False``): the inbox event it follows
        # is, and dedups a replay routed to it again. Any process crash leaves the marker
        # in place; a power cut may take it, and then a replay inside the signature's
        # window whose Redis claim was lost too is let through: answered 200 "duplicate"
        # if it routes to the same wait, but one addressed by business key alone could
        # answer a newer wait that took the key meanwhile. Narrow (a power cut, seconds
        # of write-back, a replay within minutes); flushed, the marker cost every webhook
        # a second fsync, in line behind the audit block's.
        # Stamped with when: retention deletes a marker by its age, as no inbox event
        # names the marker of a request that stored nothing new (a resent duplicate).
        stamp = b"accepted" if at is None else at.isoformat().encode()
        if at is not None and not in_inbox:
            # Named by no inbox event (a duplicate resent signed afresh, a batch whose
            # events all named no wait): listed by its hour (``keys.replay_due``), so
            # retention finds it once it is due without reading every marker at every
            # sweep. A marker an event names goes with that event's session, and every
            # webhook that stores one is spared this write. Before the marker: a crash
            # between leaves an entry naming no marker (retention drops it), never a
            # marker that nothing lists.
            with contextlib.suppress(ObjectExists):  # a retry's, or another request's
                await self.store.put_if_absent(
                    keys.replay_due(replay_hour(at), source, content_digest), b"", durable=False
                )
            crash_point(CrashPoint.REPLAY_DUE_WRITTEN)
        try:
            await self.store.put_if_absent(
                keys.accepted_content(source, content_digest), stamp, durable=False
            )
        except ObjectExists:  # remembered already (a retry after a lost answer)
            return False
        return True

    async def forget_accepted(self, *, source: str, content_digest: str) -> None:
        await self.store.delete(keys.accepted_content(source, content_digest))

    async def was_accepted(self, *, source: str, content_digest: str) -> bool:
        try:
            await self.store.get(keys.accepted_content(source, content_digest))
        except ObjectNotFound:
            return False
        return True

    async def _read(self, key: str) -> InboxEvent | None:
        try:
            obj = await self.store.get(key)
        except ObjectNotFound:
            return None
        try:
            return InboxEvent.model_validate_json(obj.data)
        except ValidationError:
            return None  # only torpor writes here; an unreadable object is not an event
