"""Named crash points, for the fault-injection tests only.

``crash_point(name)`` kills the current process with SIGKILL when the environment
variable ``TORPOR_CRASH_AT`` names that point (a comma-separated list of names). The
variable is read once, at the first crash point the process reaches (never at import:
importing torpor reads no configuration), so afterwards a process that does not set it
pays one set lookup per point and nothing else. The tests in ``tests/faults/`` start
a real session process with the variable set, watch it die at the exact step named, and
check that the next holder finishes the work from durable state: no mock stands in for
the crash, and no cleanup (``finally``, ``atexit``, buffered writes) runs, exactly as
with a ``kill -9`` or a lost host.

A process that is started again with the same environment (a Ray actor with
``max_restarts``, a pool host) would die at the same point for ever. With
``TORPOR_CRASH_ONCE_DIR`` also set, a point kills only the first process that reaches
it: each claims a file of that name in the folder first (create-only, so one process
across every restart and host wins).

Never set ``TORPOR_CRASH_AT`` in a deployment.
"""

from __future__ import annotations

import os
import signal
from enum import StrEnum
from functools import cache

ENV = "TORPOR_CRASH_AT"
ONCE_ENV = "TORPOR_CRASH_ONCE_DIR"


class CrashPoint(StrEnum):
    """Where a session process can be told to die (the durable step it dies after)."""

    SYNC_TOOL_RAN = "sync_tool.ran"  # a sync tool ran; its log entry is not committed
    SUSPEND_COMMITTED = "suspend.committed"  # SUSPENDED + waits committed; nothing bound
    WAITS_BOUND = "suspend.bound"  # waits bound in the index; no request sent
    START_SENT = "outbox.sent.start"  # a request went out; its status is not committed
    COMPENSATE_SENT = "outbox.sent.compensate"  # an undo went out (after a terminal commit)
    START_FAILED = "outbox.start_failed"  # a start settled FAILED; its wait not yet told
    # answers applied (a fan-in group may have resolved) and committed; the closed waits
    # are still bound and the compensations of the members it closed not yet sent
    WAKE_COMMITTED = "wake.committed"
    # submit (the session service)
    SUBMIT_AFTER_CLAIM = "submit.after_claim"  # Idempotency-Key claimed; no snapshot yet
    SUBMIT_AFTER_CREATE = "submit.after_create"  # snapshot created; the key not finished
    # batches (a Serve replica or the reconciler fanning a batch out)
    BATCH_RETRY = "batch.retry"  # a retry's generation is recorded; no session of it made
    BATCH_DOCUMENTS = "batch.documents"  # the documents are written; no manifest yet
    BATCH_MANIFEST = "batch.manifest"  # the manifest is written; no session created yet
    BATCH_FANOUT_CHUNK = "batch.fanout_chunk"  # a chunk of sessions made; cursor not saved
    # a page of a results export is written; the pages after it and the done record not:
    # ``batch.export_page.<page>`` (e.g. ``batch.export_page.0``), so a test picks how far
    # the writer got (a reader must not take the pages for a whole export)
    BATCH_EXPORT_PAGE = "batch.export_page"
    # the webhook edge (a Serve replica)
    GATEWAY_AFTER_CLAIM = "gateway.after_claim"  # replay claims taken; nothing stored
    GATEWAY_AFTER_INBOX = "gateway.after_inbox"  # the event is in the inbox; no wake timer
    GATEWAY_AFTER_WAKE = "gateway.after_wake"  # the wake timer is set; no replay marker
    # replay memory (any process that accepts a request, and the retention sweep): the
    # due entry is written before its marker and deleted after it, so a death between
    # leaves an entry naming no marker, never a marker that no sweep would find
    REPLAY_DUE_WRITTEN = "replay.due_written"  # a marker's due entry is stored; no marker
    REPLAY_MARKER_SWEPT = "sweep.replay_swept"  # a due marker is deleted (or gone); entry left
    # the operator's retry of a session quarantined for an undecodable snapshot: the wake
    # timer is armed before the index is told, so a death between, or before the
    # activation request, leaves the sweeper a timer to wake it by
    QUARANTINE_RETRY_ARMED = "quarantine.retry_armed"  # wake timer set; index QUARANTINED
    QUARANTINE_RETRY_RECORDED = "quarantine.retry_recorded"  # index told; no activation
    # deliveries (a Serve replica or the console resending a dead letter)
    DELIVERY_RESENT = "delivery.resent"  # a resend made the delivery pending; no timer set
    DELIVERY_CREATED = "delivery.created"  # a notice's delivery is stored; no timer set
    # the reconciler's sweep
    POLLS_LEASED = "sweep.polls_leased"  # a sweep took its due polls; no vendor asked yet
    RETENTION_PURGED = "sweep.retention_purged"  # sessions purged; the index not told yet
    # the local folder store (any process that writes through it)
    STORE_AFTER_SWAP = "store.after_swap"  # a replace is at its key; its old file in .tmp, unlogged
    STORE_AFTER_PLACE = "store.after_place"  # a create is at its key; unlogged
    STORE_AFTER_MOVE = "store.after_move"  # a deleted object's file is in .tmp; unlogged
    STORE_AFTER_LINK = "store.after_link"  # a moved object is at both keys; unlogged
    STORE_MOVE_LOGGED = "store.move_logged"  # a move is logged and flushed; its old name left
    STORE_ROWS_COMMITTED = "store.rows_committed"  # small objects committed, not yet flushed
    STORE_LOG_RESTARTED = "store.log_restarted"  # rows' log copied, to restart; not restarted
    STORE_REPLAY_REMOVING = "store.replay_removing"  # a replay is on disk; one log removed
    # a pool host took a request of this reason off its channel; the session not leased:
    # ``pool.taken.<reason>`` (e.g. ``pool.taken.recover``)
    POOL_TAKEN = "pool.taken"


@cache
def _armed() -> frozenset[str]:
    return frozenset(name.strip() for name in os.environ.get(ENV, "").split(",") if name.strip())


def crash_point(name: str) -> None:
    """Die here, at once and without cleanup, if this process was told to."""
    if name in _armed() and _first(name):
        os.kill(os.getpid(), signal.SIGKILL)


def _first(name: str) -> bool:
    """Whether this process is the one to die at ``name``: always, unless the points are
    armed once (``ONCE_ENV``), when only the first to claim its file is."""
    folder = os.environ.get(ONCE_ENV)
    if not folder:
        return True
    try:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
