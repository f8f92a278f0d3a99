"""A purged session's records (``storage.retention``): every object of the session but
its snapshot, found through its refs (or, stored by 0.2, through its snapshot and inbox),
in the order they go (``Doomed``), or none while one is still needed (a delivery still
attempted, an event inside the windows, work that may still run)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from storage import keys, submit_keys
from storage.retention_state import RetentionState, _parsed
from torpor.deliveries import Delivery, DeliveryStatus, delivery_id_for
from torpor.errors import (
    InvalidKey,
)
from torpor.events import InboxEvent
from torpor.models import OutboxKind, SessionSnapshot
from torpor.ports import WaitBinding
from torpor.work import WorkOrder, work_id

COMPENSATE_SUFFIX = ":compensate"  # a COMPENSATE entry's key: its START key + this


@dataclass
class Doomed:
    """A session's objects in the order they go. Each phase was found through objects a
    later phase deletes, so a crash between phases leaves the rest findable."""

    records: list[str] = field(default_factory=list)
    # Deliveries → the etag each was judged settled at: each goes only if unchanged since
    # (``_delete_deliveries``), before the other records.
    deliveries: dict[str, str] = field(default_factory=dict)
    # Business-key pointers → the correlation ids that make each ours (waits of several
    # epochs may have used one key). Deleted with the records, each only if it still
    # names one of them when it goes (``_delete_pointers``).
    pointers: dict[str, set[str]] = field(default_factory=dict)
    # What told the records may go: correlation records (a 0.2 business-key pointer is
    # known to be ours by the record it names) and work outcomes and stop markers (work
    # with neither may still run, see ``_work_over``).
    deciding: list[str] = field(default_factory=list)
    # Inbox events and refs: what the phases before were found through.
    finders: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return (
            len(self.records)
            + len(self.deliveries)
            + len(self.pointers)
            + len(self.deciding)
            + len(self.finders)
        )


class SessionRecords(RetentionState):
    """What of an ended session goes, and whether it may go yet."""

    async def _records(
        self, snapshot: SessionSnapshot, window_start: datetime, cutoff: datetime
    ) -> Doomed | None:
        """Every object of the session but its snapshot, or None if one is still needed."""
        session_id = snapshot.session_id
        doomed = Doomed()
        answered: set[str] = set()  # correlation ids of the events in its inbox
        for event_key in await self._list(keys.inbox_prefix(session_id)):
            doomed.finders.append(event_key)
            event = await self._read(event_key, InboxEvent)
            if event is None:
                continue
            if event.received_at > window_start:
                return None  # its replay marker still guards the replay window
            if event.content_digest:
                doomed.records.append(keys.accepted_content(event.source, event.content_digest))
            if event.correlation_id:
                answered.add(event.correlation_id)
        referenced: set[str] = set()
        delivered: set[str] = set()
        works: set[str] = set()
        refs = keys.refs_prefix(session_id)
        for ref in await self._list(refs):
            doomed.finders.append(ref)
            kind, _, rest = ref.removeprefix(refs).partition("/")
            if kind == "c":
                referenced.add(rest)
                doomed.deciding.append(keys.correlation(rest))
                pointer = await self._data(ref)
                if pointer:  # goes only if the business key still names ours then
                    doomed.pointers.setdefault(pointer.decode(), set()).add(rest)
            elif kind == "d":
                tenant, _, delivery_id = rest.partition("/")
                delivered.add(delivery_id)
                if not await self._settled_delivery(tenant, delivery_id, doomed):
                    return None  # still being attempted
                doomed.records.append(keys.dead_letter(tenant, delivery_id))
                doomed.records.append(keys.pending_delivery(tenant, delivery_id))
            elif kind == "w":
                works.add(rest)
            elif kind == "i":
                tenant, _, hashed = rest.partition("/")
                record = keys.submit_key(tenant, hashed)
                if await self._names(record, session_id):  # not the key's later session's
                    doomed.records.append(record)
        await self._unreferenced(snapshot, referenced, answered, doomed)
        if not await self._unreferenced_deliveries(snapshot, delivered, doomed):
            return None
        for work in sorted(works):
            found = await self._list(keys.work_prefix(work))
            if not await self._work_over(work, found, cutoff):
                return None
            decided = {keys.work_outcome(work), keys.work_stopped(work)}
            doomed.records += [k for k in found if k not in decided]
            doomed.deciding += [k for k in found if k in decided]
        doomed.deciding += _stopped_without_order(snapshot, works)
        doomed.records += await self._list(keys.progress_prefix(session_id))
        return doomed

    async def _unreferenced(
        self, snapshot: SessionSnapshot, referenced: set[str], answered: set[str], doomed: Doomed
    ) -> None:
        """Correlation records and business-key pointers that no ref names: a session
        stored by 0.2 wrote them without refs. Its snapshot still names its waits' ids (the
        outbox's START and COMPENSATE entries, the 32 settled ones it keeps, and any wait
        still open) and its business keys; its inbox names the answered waits' ids. A
        record goes only if it names this session, a pointer only if it names one of ours:
        a later session may hold the same business key by now. A wait that was never
        answered and whose entry the outbox dropped cannot be found: its record stays."""
        sid = snapshot.session_id
        ours = {e.correlation_id for e in snapshot.outbox if e.correlation_id}
        ours |= {w.correlation_id for w in snapshot.waits}
        ours |= {m.correlation_id for group in snapshot.fan_ins for m in group.members}
        mine = set(referenced)
        for cid in sorted((ours | answered) - referenced):
            if await self._names_session(cid, sid):
                mine.add(cid)
                doomed.deciding.append(keys.correlation(cid))
        for business_key in snapshot.business_keys:
            pointer = keys.business_key(snapshot.tenant, business_key)
            named = await self._data(pointer)
            if named is None:
                continue
            cid = named.decode(errors="replace")
            if cid in mine or cid in ours:
                doomed.pointers.setdefault(pointer, set()).add(cid)
            elif await self._names_session(cid, sid):  # a wait the outbox no longer names
                doomed.pointers.setdefault(pointer, set()).add(cid)
                doomed.deciding.append(keys.correlation(cid))

    async def _unreferenced_deliveries(
        self, snapshot: SessionSnapshot, delivered: set[str], doomed: Doomed
    ) -> bool:
        """Deliveries no ref names (0.2 wrote none), found through the snapshot's NOTIFY
        entries (the terminal one is the newest, so the outbox keeps it); False while one
        is still being attempted."""
        for entry in snapshot.outbox:
            if entry.kind is not OutboxKind.NOTIFY:
                continue
            delivery_id = delivery_id_for(entry.idempotency_key)
            if delivery_id in delivered:
                continue
            key = keys.delivery(snapshot.tenant, delivery_id)
            found = await self._stored(key)
            delivery = None if found is None else _parsed(found.data, Delivery)
            if found is None or delivery is None or delivery.session_id != snapshot.session_id:
                continue
            if delivery.status is DeliveryStatus.PENDING:
                return False
            doomed.deliveries[key] = found.etag
            doomed.records.append(keys.dead_letter(snapshot.tenant, delivery_id))
            doomed.records.append(keys.pending_delivery(snapshot.tenant, delivery_id))
        return True

    async def _settled_delivery(self, tenant: str, delivery_id: str, doomed: Doomed) -> bool:
        """Whether a delivery is no longer being attempted; if it is stored, noted with
        its etag to go."""
        key = keys.delivery(tenant, delivery_id)
        found = await self._stored(key)
        if found is None:
            return True
        delivery = _parsed(found.data, Delivery)
        if delivery is not None and delivery.status is DeliveryStatus.PENDING:
            return False
        doomed.deliveries[key] = found.etag
        return True

    async def _names(self, submit_key: str, session_id: str) -> bool:
        data = await self._data(submit_key)
        if data is None:
            return False
        try:
            return submit_keys.decode(data).session_id == session_id
        except (ValueError, KeyError, TypeError, InvalidKey):
            return False  # unreadable: left for an operator, as other records are

    async def _names_session(self, correlation_id: str, session_id: str) -> bool:
        try:
            key = keys.correlation(correlation_id)
        except InvalidKey:
            return False
        binding = await self._read(key, WaitBinding)
        return binding is not None and binding.session_id == session_id

    async def _work_over(self, work: str, found: list[str], cutoff: datetime) -> bool:
        """Whether a work's records may go: it recorded an outcome, or was stopped (a
        cancel, timeout or drift compensates the session's open waits, which stops it), or
        never got as far as its order. An ended session may still have work running
        without either: it failed (agent error, guard block) with a work wait open, which
        nothing compensates. Deleting its records then would let the watcher write an
        outcome and an inbox event for a session that is gone, so the session is kept
        until the work's own deadline is a whole retention period in the past: a watcher
        still alive by then is lost in all but name, and the records must not live
        forever."""
        if keys.work_outcome(work) in found or keys.work_stopped(work) in found:
            return True
        if keys.work_order(work) not in found:
            return True  # a ref whose order was never written, or a purge that crashed
        data = await self._data(keys.work_order(work))
        if data is None:
            return True
        try:
            order = WorkOrder.from_data(json.loads(data))
        except (ValueError, TypeError, KeyError):
            return False  # never delete what cannot be read: an operator looks first
        return order.deadline <= cutoff


def _stopped_without_order(snapshot: SessionSnapshot, works: set[str]) -> list[str]:
    """Stop markers of work that no ref names: a cancel can stop work whose start never
    got as far as its order (and ref). Only a COMPENSATE entry still names that work; its
    id, a digest of a key holding this session's id, is no other session's."""
    stopped: list[str] = []
    for entry in snapshot.outbox:
        if entry.kind is not OutboxKind.COMPENSATE:
            continue
        work = work_id(entry.idempotency_key.removesuffix(COMPENSATE_SUFFIX))
        if work not in works:
            stopped.append(keys.work_stopped(work))
    return stopped
