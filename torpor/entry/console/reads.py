"""What the console shows, read from the index, the snapshots, the inbox, the deliveries
and the audit log. Reads only: nothing here changes a session.

Listings walk the session registry (newest first, cursor = the last session id shown)
and read each listed snapshot for what the registry does not hold (agent, batch, next
deadline). Filters that need the snapshot scan at most ``SCAN_CAP`` ids per page, so a
filter that matches nothing answers quickly with a cursor to scan on from.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from torpor.deliveries import Delivery, DeliveryStatus
from torpor.errors import NotFound, SessionNotFound, SnapshotCorrupt, TorporError
from torpor.events import InboxEvent
from torpor.lifecycle import SessionState
from torpor.models import SessionSnapshot, Wait
from torpor.ports.services import Services
from torpor.service import quarantine

SCAN_CAP = 500  # ids one listing page may read while filtering
COUNT_CAP = 10_000  # per tenant and state; the console shows "10000+" past it
SOON_SCAN = 200  # suspended sessions read for "waits due soon"
AUDIT_BLOCKS = 8  # recent audit blocks per stream the console reads


class AuditBrowser(Protocol):
    """What the console reads of the audit log (``storage.audit.ObjectAudit``)."""

    async def recent(self, *, blocks: int = ...) -> list[Any]: ...

    async def verify_all(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Filters:
    tenant: str | None = None
    agent: str | None = None
    batch: str | None = None
    state: SessionState | None = None
    due_within_s: float | None = None

    def needs_snapshot(self) -> bool:
        return bool(self.agent or self.batch or self.due_within_s is not None)


@dataclass(frozen=True)
class Row:
    session_id: str
    tenant: str
    state: SessionState
    agent: str
    batch_id: str | None
    next_deadline: datetime | None
    updated_at: datetime


@dataclass(frozen=True)
class Page:
    rows: list[Row]
    next_cursor: str | None


def next_deadline(snapshot: SessionSnapshot) -> datetime | None:
    return min((w.deadline for w in snapshot.waits), default=None)


async def _load(services: Services, session_id: str) -> SessionSnapshot | None:
    try:
        return await services.snapshots.load(session_id)
    except SnapshotCorrupt as exc:
        # A poison snapshot is shown for what it is (QUARANTINED, the decode error as the
        # reason), as the session API shows it, so an operator can find and retry it.
        try:
            return await quarantine.stand_in(services, session_id, exc)
        except TorporError:
            return None
    except TorporError:  # gone, or not a session id
        return None


def _row(snapshot: SessionSnapshot, state: SessionState | None) -> Row:
    return Row(
        snapshot.session_id,
        snapshot.tenant,
        state or snapshot.state,
        snapshot.agent.name,
        snapshot.batch_id,
        next_deadline(snapshot),
        snapshot.updated_at,
    )


def _matches(row: Row, filters: Filters, now: datetime) -> bool:
    if filters.agent and row.agent != filters.agent:
        return False
    if filters.batch and row.batch_id != filters.batch:
        return False
    if filters.due_within_s is not None:
        horizon = now + timedelta(seconds=filters.due_within_s)
        return row.next_deadline is not None and row.next_deadline <= horizon
    return True


async def _ids(
    services: Services, tenants: list[str], state: SessionState | None, cursor: str | None, n: int
) -> tuple[list[tuple[str, str]], bool]:
    """The next ``n`` (session id, tenant) newest first across ``tenants``, merged by id
    (ids begin with their creation time), and whether more follow."""
    pages = await asyncio.gather(
        *(
            services.index.list_sessions(tenant=t, state=state, cursor=cursor, limit=n)
            for t in tenants
        )
    )
    merged = sorted(
        ((sid, t) for t, page in zip(tenants, pages, strict=True) for sid in page.session_ids),
        reverse=True,
    )
    more = len(merged) > n or any(p.next_cursor for p in pages)
    return merged[:n], more


async def list_sessions(
    services: Services,
    *,
    tenants: list[str],
    filters: Filters,
    cursor: str | None,
    limit: int,
    now: datetime,
) -> Page:
    if filters.tenant:
        tenants = [t for t in tenants if t == filters.tenant]
    rows: list[Row] = []
    scanned = 0
    while len(rows) < limit and scanned < SCAN_CAP:
        batch, more = await _ids(services, tenants, filters.state, cursor, limit)
        if not batch:
            return Page(rows, None)
        states = await services.index.session_states([sid for sid, _ in batch])
        snaps = await asyncio.gather(*(_load(services, sid) for sid, _ in batch))
        for (sid, _tenant), snap in zip(batch, snaps, strict=True):
            scanned += 1
            cursor = sid
            if snap is None:
                continue
            row = _row(snap, states.get(sid))
            if _matches(row, filters, now):
                rows.append(row)
                if len(rows) == limit:
                    break
        if not more:
            last = batch[-1][0]
            return Page(rows, None if cursor == last else cursor)
    return Page(rows, cursor)


async def counts(services: Services, tenants: list[str]) -> dict[str, int]:
    """Sessions per state across ``tenants`` (capped at ``COUNT_CAP`` per tenant and state)."""

    async def count(tenant: str, state: SessionState) -> int:
        total, cursor = 0, None
        while total < COUNT_CAP:
            page = await services.index.list_sessions(
                tenant=tenant, state=state, cursor=cursor, limit=1000
            )
            total += len(page.session_ids)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        return total

    states = list(SessionState)
    found = await asyncio.gather(*(count(t, s) for t in tenants for s in states))
    totals: Counter[str] = Counter()
    for i, n in enumerate(found):
        totals[states[i % len(states)].value] += n
    return {s.value: totals[s.value] for s in states}


async def find(services: Services, query: str, *, tenants: list[str], now: datetime) -> str | None:
    """The session a session id, correlation id or business key names, within ``tenants``."""
    query = query.strip()[:256]
    if not query:
        return None
    snap = await _load(services, query) if query.startswith("s_") or len(query) > 20 else None
    if snap is not None:
        return snap.session_id if snap.tenant in tenants else None
    for tenant in tenants:
        for by in ("correlation_id", "business_key"):
            try:
                binding = await services.index.resolve(tenant=tenant, now=now, **{by: query})
            except TorporError:
                binding = None
            if binding is not None:
                return binding.session_id
    # The durable correlation records outlive the index binding (a closed or expired wait).
    try:
        record = await services.correlations.lookup(query)
    except TorporError:
        record = None
    if record is not None and record.tenant in tenants:
        return record.session_id
    for tenant in tenants:
        try:
            record = await services.correlations.lookup_business_key(
                tenant=tenant, business_key=query
            )
        except TorporError:
            record = None
        if record is not None:
            return record.session_id
    return None


# -- one session ------------------------------------------------------------------------


@dataclass(frozen=True)
class InboxLine:
    event: InboxEvent
    verdict: str  # applied, pending, observed: <reason>


@dataclass
class Timeline:
    snapshot: SessionSnapshot
    inbox: list[InboxLine] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    audit: list[Any] = field(default_factory=list)


def verdict(snapshot: SessionSnapshot, event: InboxEvent) -> str:
    observed = {o.event_key: o.reason.value for o in snapshot.observations}
    if event.key in observed:
        return f"observed: {observed[event.key]}"
    if event.key in snapshot.processed_events:
        return "applied"
    return "pending"


async def session_deliveries(
    services: Services, tenant: str, session_id: str, *, pages: int = 10
) -> list[Delivery]:
    found: list[Delivery] = []
    cursor: str | None = None
    for _ in range(pages):
        items, cursor = await services.deliveries.list(
            tenant, status=None, cursor=cursor, limit=200
        )
        found += [d for d in items if d.session_id == session_id]
        if cursor is None:
            break
    return found


async def timeline(
    services: Services, snapshot: SessionSnapshot, audit: AuditBrowser | None
) -> Timeline:
    events = await services.inbox.pending(snapshot.session_id, processed=())
    records = await audit.recent(blocks=AUDIT_BLOCKS) if audit is not None else []
    return Timeline(
        snapshot,
        [InboxLine(e, verdict(snapshot, e)) for e in events],
        await session_deliveries(services, snapshot.tenant, snapshot.session_id),
        [r for r in records if getattr(r, "session_id", None) == snapshot.session_id],
    )


# -- the whole deployment -----------------------------------------------------------------


@dataclass(frozen=True)
class SoonWait:
    session_id: str
    tenant: str
    wait: Wait


async def waits_due_soon(
    services: Services, tenants: list[str], *, now: datetime, within: timedelta
) -> list[SoonWait]:
    batch, _ = await _ids(services, tenants, SessionState.SUSPENDED, None, SOON_SCAN)
    snaps = await asyncio.gather(*(_load(services, sid) for sid, _ in batch))
    soon = [
        SoonWait(s.session_id, s.tenant, w)
        for s in snaps
        if s is not None
        for w in s.waits
        if w.deadline <= now + within
    ]
    return sorted(soon, key=lambda x: x.wait.deadline)


async def dead_letters(
    services: Services, tenants: list[str], *, limit: int = 50
) -> list[Delivery]:
    found: list[Delivery] = []
    for tenant in tenants:
        items, _ = await services.deliveries.list(
            tenant, status=DeliveryStatus.DEAD, cursor=None, limit=limit
        )
        found += items
    return found[:limit]


def webhook_outcomes(
    records: list[Any], tenants_sources: set[str] | None
) -> dict[str, Counter[str]]:
    """Audit verdicts counted per source (operator actions apart); ``tenants_sources``
    limits it to a tenant's own sources."""
    table: dict[str, Counter[str]] = {}
    for r in records:
        if r.source.startswith("operator:"):
            continue
        if tenants_sources is not None and r.source not in tenants_sources:
            continue
        table.setdefault(r.source, Counter())[r.verdict] += 1
    return table


async def get_snapshot(
    services: Services, session_id: str, *, tenants: list[str]
) -> SessionSnapshot:
    """A session the principal may see; SessionNotFound for any other (no hint it exists)."""
    snap = await _load(services, session_id[:128])
    if snap is None or snap.tenant not in tenants:
        raise SessionNotFound(f"no session {session_id[:80]!r}")
    return snap


async def get_delivery(
    services: Services, tenant: str, delivery_id: str, *, tenants: list[str]
) -> Delivery:
    if tenant not in tenants:
        raise NotFound(f"no delivery {delivery_id[:80]!r}")
    return await services.deliveries.get(tenant, delivery_id)
