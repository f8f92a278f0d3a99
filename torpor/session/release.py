"""The end of an activation's lease: the lease released, and with it, in one round trip,
the session's wake-up unscheduled and a quarantine its snapshot belies lifted."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from torpor.errors import IndexUnavailable
from torpor.models import SessionSnapshot
from torpor.ports import Index, TimerKind
from torpor.session.heartbeat import Heartbeat

log = logging.getLogger(__name__)


async def let_go(
    index: Index,
    heartbeat: Heartbeat,
    session_id: str,
    *,
    unschedule: bool,
    lift: SessionSnapshot | None = None,
) -> None:
    """Release the lease and, after a drive that ran to its end, unschedule the
    session's wake-up: both asked for in one turn, so they leave in one pipeline (one
    round trip, not two in a row), the release first as before. A release that fails
    is let be (the lease expires by itself); a failed unschedule is raised, as it was
    when it came second.

    ``lift``: the snapshot such a drive left without recording its state. The index
    alone says QUARANTINED when a snapshot did not decode; an operator's retry that
    died before it recorded the state back (``quarantine.retry_armed``) left it so,
    and the activation its wake-up asked for, finding the snapshot restored, had
    nothing to commit: the registry said QUARANTINED of a healthy session until the
    next full repair. So the quarantine is lifted here
    (``SessionRegistry.lift_quarantine``: only over a QUARANTINED no newer than the
    snapshot, never over a state recorded since), in the same pipeline: no activation
    pays a round trip for it. It goes first: it runs while the lease is held, and
    the server took it whenever it took the unschedule (an index must keep that order
    even when its server forgot its scripts: Redis sends the lift by its source).
    Its failure is raised as the unschedule's is."""
    release = index.release_lease(heartbeat.lease)
    if not unschedule:
        with contextlib.suppress(IndexUnavailable):  # it expires by itself anyway
            await release
        return
    lifting = (
        []
        if lift is None
        else [
            index.lift_quarantine(
                tenant=lift.tenant,
                session_id=session_id,
                state=lift.state,
                generation=lift.generation,
            )
        ]
    )
    *lifted, released, unscheduled = await asyncio.gather(
        *lifting,
        release,
        index.unschedule(kind=TimerKind.WAKE, member=session_id),
        return_exceptions=True,
    )
    for outcome in (*lifted, released, unscheduled):
        if isinstance(outcome, BaseException) and not isinstance(outcome, IndexUnavailable):
            raise outcome
    for outcome in (unscheduled, *lifted):
        if isinstance(outcome, BaseException):
            raise outcome
    if lifted == [True]:
        log.info("session %s reads again: its quarantine in the index is lifted", session_id)
