"""Dead letters: outbox entries that gave up for good, and the operator's resend.

A compensation or a notice that exhausts its attempts (or fails permanently) stays in the
snapshot's outbox with status DEAD (``torpor.outbox.settle``) and is reported through the
observer's ``dead_letter`` hook. ``resend`` puts one back to PENDING with a fresh round of
attempts; the next activation sends it under the same idempotency key, so a far side that
did receive an earlier attempt still applies it once.

The resend is a commit like any other: it takes the session's lease (seeding the fence
from the snapshot, as the runtime does) and goes through the working copy's fenced
compare-and-swap, so it can never overwrite an activation's work.
"""

from __future__ import annotations

import contextlib

from torpor import outbox
from torpor.errors import IndexUnavailable, InvalidRequest, SessionBusy
from torpor.models import DispatchStatus, OutboxEntry
from torpor.ports.services import Services
from torpor.session.heartbeat import Heartbeat
from torpor.session.runtime import lease_name
from torpor.session.working import WorkingCopy


async def resend(deps: Services, session_id: str, entry_id: str, *, owner: str) -> OutboxEntry:
    """Put dead letter ``entry_id`` back to PENDING; the caller then activates the session.

    Idempotent: an entry already PENDING (resent before) is returned as it is. Raises
    ``SessionBusy`` while an activation holds the session, ``InvalidRequest`` for an entry
    that does not exist or is not a dead letter."""
    config, index = deps.config, deps.index
    lease = await index.acquire_lease(
        name=lease_name(session_id), owner=owner, ttl=config.lease_ttl, now=deps.clock.now()
    )
    if lease is None:
        raise SessionBusy(f"session {session_id} is running; resend when it is idle")
    heartbeat = Heartbeat(
        index, lease, clock=deps.clock, period=config.heartbeat_period, ttl=config.lease_ttl
    )
    try:
        snapshot = await deps.snapshots.load(session_id)
        if snapshot.lease_fence >= heartbeat.lease.token:
            await heartbeat.refence(snapshot.lease_fence)  # the index lost its counter
        entry = next((e for e in snapshot.outbox if e.entry_id == entry_id), None)
        if entry is None:
            raise InvalidRequest(f"session {session_id} has no outbox entry {entry_id!r}")
        if entry.status is DispatchStatus.PENDING:
            return entry
        if entry.status is not DispatchStatus.DEAD:
            raise InvalidRequest(
                f"outbox entry {entry_id!r} is {entry.status.value}, not a dead letter"
            )
        revived = outbox.revive(entry)
        work = WorkingCopy(deps, snapshot, heartbeat)
        work.update(outbox=[revived if e.entry_id == entry_id else e for e in snapshot.outbox])
        await work.commit()
        return revived
    finally:
        deps.snapshots.release(session_id)
        await heartbeat.stop()
        with contextlib.suppress(IndexUnavailable):  # it expires by itself anyway
            await index.release_lease(heartbeat.lease)
