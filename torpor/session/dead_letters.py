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
from torpor.errors import (
    IndexUnavailable,
    InvalidRequest,
    OutboxEntryNotSendable,
    PluginNotFound,
    SessionBusy,
)
from torpor.lifecycle import SessionState
from torpor.models import DispatchStatus, OutboxEntry, OutboxKind, SessionSnapshot
from torpor.ports.services import Services
from torpor.session.heartbeat import Heartbeat
from torpor.session.runtime import lease_name
from torpor.session.working import WorkingCopy
from torpor.tools import LongRunningTool


async def resend(deps: Services, session_id: str, entry_id: str, *, owner: str) -> OutboxEntry:
    """Put dead letter ``entry_id`` back to PENDING; the caller then activates the session.

    Idempotent: an entry already PENDING (resent before) is returned as it is. Raises
    ``SessionBusy`` while an activation holds the session, ``InvalidRequest`` for an entry
    that does not exist or is not a dead letter, ``OutboxEntryNotSendable`` for one this
    cluster cannot send (it stays a dead letter)."""
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
        ensure_sendable(deps, snapshot, entry)
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


def ensure_sendable(deps: Services, snapshot: SessionSnapshot, entry: OutboxEntry) -> None:
    """Refuse a resend nothing here would send. An undo goes out through the agent's
    long-running tool, and the activation sends none for a session whose agent is not
    configured: revived regardless, the entry would sit PENDING for ever, and leave the
    operator's dead letters as if it had been sent. A notice needs no tool. A session
    set aside sends nothing until an operator takes it back (its timers are gone): the
    resend is refused until then, not left PENDING."""
    if snapshot.state is SessionState.QUARANTINED:
        raise OutboxEntryNotSendable(
            f"session {snapshot.session_id} is QUARANTINED: retry or cancel it first"
        )
    if entry.kind is OutboxKind.NOTIFY:
        return
    name = snapshot.agent.name
    try:
        loaded = deps.plugins.agent(name)
    except PluginNotFound:
        raise OutboxEntryNotSendable(
            f"agent {name!r} is not configured on this cluster: configure it, then resend"
        ) from None
    tool = loaded.tools.get(entry.tool_name or "")
    if not isinstance(tool, LongRunningTool):
        raise OutboxEntryNotSendable(
            f"tool {entry.tool_name!r} of agent {name!r} is not a long-running tool here"
        )
