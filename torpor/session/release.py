"""The end of an activation's lease: the lease released, and with it, in one round trip,
the session's wake-up unscheduled and a quarantine its snapshot belies lifted."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from torpor.errors import IndexUnavailable, SnapshotError, TorporError
from torpor.models import SessionSnapshot
from torpor.ports import Index, SnapshotRepository, TimerKind
from torpor.session.heartbeat import Heartbeat

log = logging.getLogger(__name__)


async def let_go(
    index: Index,
    heartbeat: Heartbeat,
    session_id: str,
    *,
    unschedule: bool,
    lift: SessionSnapshot | None = None,
    snapshots: SnapshotRepository | None = None,
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
    Its failure is raised as the unschedule's is.

    A quarantine newer than ``lift`` (a backup older than the undecodable snapshot was
    restored, and the operator's retry died before its own lift at the quarantine's
    generation) refuses that lift: its generation, read after the lift and before the
    release in their order (``SessionRegistry.quarantine_generation``), tells, and
    ``_past_restore`` lifts it then, in a step of its own (``snapshots`` reads the
    header it checks first)."""
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
            ),
            # After the lift and before the release, in their order (one pipeline on
            # Redis): the quarantine that refused the lift, read while the lease was
            # still ours. No tenant looked up, no round trip of its own.
            index.quarantine_generation(session_id),
        ]
    )
    *asked, released, unscheduled = await asyncio.gather(
        *lifting,
        release,
        index.unschedule(kind=TimerKind.WAKE, member=session_id),
        return_exceptions=True,
    )
    # The quarantine's read (``asked[1]``) only informs what follows: one that failed is
    # read as none, never raised over the work the activation did.
    lifted_or_failed = asked[:1]
    for outcome in (*lifted_or_failed, released, unscheduled):
        if isinstance(outcome, BaseException) and not isinstance(outcome, IndexUnavailable):
            raise outcome
    for outcome in (unscheduled, *lifted_or_failed):
        if isinstance(outcome, BaseException):
            raise outcome
    if lift is None:
        return
    lifted, aside_at = asked
    if (
        lifted is False
        and released is True
        and snapshots is not None
        and isinstance(aside_at, int)
        and aside_at > lift.generation
    ):
        lifted = await _past_restore(index, snapshots, lift, aside_at)
    if lifted is True:
        log.info("session %s reads again: its quarantine in the index is lifted", session_id)


async def _past_restore(
    index: Index, snapshots: SnapshotRepository, lift: SessionSnapshot, aside_at: int
) -> bool:
    """Lift a quarantine newer than the snapshot this activation read and found readable.
    Its generation is the one the undecodable snapshot's header named; the store holds an
    older one now (a backup restored from before it), so that snapshot is gone and the
    quarantine describes nothing. "No newer" guards a state against a late holder of an
    older snapshot, which this is not: the lease was ours until the quarantine's generation
    ``aside_at`` was read (the release that followed the read, in order, held), so no holder
    recorded anything since our read; and the store's header, read now, still names the
    generation we read, so it was not spoiled again since (a holder after us that finds it
    so records its own quarantine). Over a QUARANTINED only, as the operator's retry lifts
    it: a state recorded meanwhile stands, and only at the generation read
    (``quarantined_at``): a quarantine recorded since at a newer one stays. The window left,
    between this header read and the lift, needs the store spoiled again and a holder after
    us to record it, at the same generation, within it.

    Best effort, after the activation's work is done and its lease released: a store or
    index that fails now is logged, never raised over the activation's own outcome (the
    quarantine stays until the next activation or the operator's retry lifts it)."""
    try:
        header = await snapshots.header(lift.session_id)
        if header.generation != lift.generation:
            return False  # the store moved on since our read: the next holder judges it
        return await index.lift_quarantine(
            tenant=lift.tenant,
            session_id=lift.session_id,
            state=lift.state,
            generation=lift.generation,
            quarantined_at=aside_at,
        )
    except SnapshotError:
        return False  # it does not read now: the quarantine may be true again
    except TorporError:
        log.warning(
            "session %s: its quarantine past a restored backup was not lifted",
            lift.session_id,
            exc_info=True,
        )
        return False
