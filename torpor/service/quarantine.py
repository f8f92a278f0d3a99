"""Quarantine, as the control plane sees it: a poison snapshot shown for what it is, and
the operator's retry.

A session is set aside (QUARANTINED) by its runtime when its retries are spent, with the
reason in its snapshot; or, when its snapshot does not decode, in the index's session
registry only, since such a snapshot cannot be rewritten: then the decode error is the
reason, found again on every read. Cancel works on both through the usual inbox event.
The operator's retry of either leaves a wake-up timer under its activation request, so a
lost request is asked again by the reconciler.
"""

from __future__ import annotations

from typing import Protocol

from torpor.clock import from_ms
from torpor.errors import InvalidRequest, PluginNotFound, SnapshotCorrupt, SnapshotError
from torpor.events import EventKind, InboxEvent
from torpor.faults import CrashPoint, crash_point
from torpor.ids import session_id_ms
from torpor.lifecycle import SessionState
from torpor.models import AgentRef, Quarantine, SessionSnapshot
from torpor.ports import Reason, SessionEntry, TimerKind
from torpor.ports.services import Services
from torpor.session.suspend import poll_member, schedule_tool_timers
from torpor.tools import LongRunningTool


class _Sessions(Protocol):
    """What the retry needs of the session service (which calls it: no import back)."""

    services: Services

    async def get(self, session_id: str, *, tenant: str | None = None) -> SessionSnapshot: ...

    async def activate(
        self, session_id: str, *, reason: Reason, agent: str | None = None
    ) -> None: ...

    async def deliver(self, event: InboxEvent) -> bool: ...

    async def arm_wake(self, session_id: str) -> None: ...


POISON = frozenset({SnapshotCorrupt.code})


async def stand_in(services: Services, session_id: str, exc: SnapshotCorrupt) -> SessionSnapshot:
    """A snapshot that does not decode, shown as what it is: QUARANTINED, with the
    decode error as the reason, built from its header (which reads on its own). If not
    even the header reads, from what the index holds of it (``_unread``); if the index
    holds nothing either, the error itself is the answer."""
    try:
        header = await services.snapshots.header(session_id)
    except SnapshotError:
        entry = await services.index.session_entry(session_id)
        if entry is None:
            raise exc from None
        return _unread(session_id, entry, exc)
    return SessionSnapshot(
        session_id=session_id,
        tenant=header.tenant,
        agent=AgentRef(name=header.agent, version=""),
        state=SessionState.QUARANTINED,
        epoch=header.epoch,
        generation=header.generation,
        trace_id="",
        quarantine=Quarantine(
            reason=str(exc), code=exc.code, at=header.updated_at, resume_to=header.state
        ),
        created_at=header.updated_at,
        updated_at=header.updated_at,
    )


def _unread(session_id: str, entry: SessionEntry, exc: SnapshotCorrupt) -> SessionSnapshot:
    """The stand-in of a snapshot whose header does not read either: its tenant and
    generation as the index holds them, its times the id's creation time (nothing else
    tells them). Raised instead, the decode error answered GET /v1/sessions/{id} with a
    500 and the operator's retry (which reads the session first) with the same, so a
    session the index had set aside could be neither seen nor taken back. Its state to
    resume is not known: ``resume_to`` QUARANTINED says so, and the retry leaves the
    index's quarantine for the activation to lift once the snapshot reads (``retry``)."""
    at = from_ms(session_id_ms(session_id) or 0)
    return SessionSnapshot(
        session_id=session_id,
        tenant=entry.tenant,
        agent=AgentRef(name="", version=""),
        state=SessionState.QUARANTINED,
        generation=entry.generation,
        trace_id="",
        quarantine=Quarantine(
            reason=str(exc), code=exc.code, at=at, resume_to=SessionState.QUARANTINED
        ),
        created_at=at,
        updated_at=at,
    )


async def retry(control: _Sessions, session_id: str, *, tenant: str | None) -> SessionSnapshot:
    """Operator action: take a QUARANTINED session back where it was set aside, with a
    fresh retry quota. Idempotent per quarantine: the request is one inbox event named
    for it. A poison snapshot is simply activated again (it may read now, e.g. once
    restored); if it still does not, it is quarantined again."""
    snapshot = await control.get(session_id, tenant=tenant)
    aside = snapshot.quarantine
    poison = aside is not None and aside.code in POISON  # a stand-in: it does not decode
    if poison or snapshot.state is not SessionState.QUARANTINED:
        indexed = await control.services.index.session_entry(session_id)
        if indexed is None or indexed.state is not SessionState.QUARANTINED:
            raise InvalidRequest(f"session {session_id} is {snapshot.state}, not QUARANTINED")
        # Quarantined in the index only (its snapshot did not decode): put the state
        # the snapshot holds back in the index, and let an activation try again. The
        # wake-up timer first: once the index no longer says QUARANTINED, the operator
        # cannot retry again, and a request lost after the record (the process died, no
        # actor took it) left nothing to activate the session; it never found out
        # whether its snapshot reads now. The activation removes the timer either way;
        # dead before the record, the index still says QUARANTINED, and the activation
        # that finds the snapshot reads lifts it (``torpor.session.release.let_go``).
        if not poison:
            await _arm_timers(control.services, snapshot)
        await control.arm_wake(session_id)
        crash_point(CrashPoint.QUARANTINE_RETRY_ARMED)
        # Over the QUARANTINED read above, whatever its generation: it carries the one the
        # undecodable snapshot's header named, and a backup restored from before it is
        # older. "Newest wins" guards a state against a late record of what an older
        # snapshot said; here the snapshot just read is the newest there is (the one the
        # quarantine names did not decode and is gone), and the operator's retry is the
        # explicit act that says so. But only over the quarantine read above, at its
        # generation: any state recorded since the look is kept, a newer quarantine (a
        # newer snapshot found undecodable meanwhile) too, which this look never saw.
        # Dead before this, the activation its wake-up asks for lifts it (``let_go``), a
        # newer quarantine too once it sees the store still holds what it read.
        resume_to = aside.resume_to if poison and aside else snapshot.state
        if resume_to is not SessionState.QUARANTINED:
            # QUARANTINED: a stand-in whose header did not read either, its state not
            # known. The index keeps its quarantine (another retry stays possible), and
            # the activation lifts it if the snapshot reads by then (``let_go``).
            await control.services.index.lift_quarantine(
                tenant=snapshot.tenant,
                session_id=session_id,
                state=resume_to,
                generation=snapshot.generation,
                quarantined_at=indexed.generation,
            )
        crash_point(CrashPoint.QUARANTINE_RETRY_RECORDED)
        await control.activate(session_id, reason=Reason.RETRY)
        return snapshot
    assert aside is not None
    await control.deliver(
        InboxEvent.new(
            kind=EventKind.RETRY,
            session_id=session_id,
            source="torpor",
            event_id=f"retry:{aside.at.isoformat()}",
            type="torpor.session.retry",
            received_at=control.services.clock.now(),
        )
    )
    return snapshot


async def _arm_timers(services: Services, snapshot: SessionSnapshot) -> None:
    """The poll and tool timers (a reminder, an escalation) of a restored snapshot's
    waits, before anything else the retry does (a retry killed later leaves them armed).
    The sweep drops those of a session set aside because its snapshot did not decode
    (``Sweeper._drop_set_aside``), and nothing else puts them back but the periodic full
    repair, up to an hour on, and that one not a tool timer whose time has passed. Moved
    earlier if due later (``keep_earlier``): a sweep that leased one before the restore
    drops it only if it is still where its lease left it. A tool timer that had fired
    before the session was set aside fires again and delivers nothing: its event is
    created once, by its name (``Sweeper._tool_timer``)."""
    try:
        tools = services.plugins.agent(snapshot.agent.name).tools
    except PluginNotFound:
        return
    now, index = services.clock.now(), services.index
    for wait in snapshot.waits:
        tool = tools.get(wait.tool_name)
        if not isinstance(tool, LongRunningTool):
            continue
        if tool.can_poll:
            await index.schedule(
                kind=TimerKind.POLL,
                member=poll_member(snapshot.session_id, wait.correlation_id),
                at=max(now, wait.overdue_after),
                keep_earlier=True,
            )
        await schedule_tool_timers(index, snapshot.session_id, wait, tool, keep_earlier=True)
