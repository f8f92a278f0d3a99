"""An actor's process that is exiting ends within a grace, whatever holds it.

Ray lets an async actor that called ``exit_actor`` go only once every call it is running
has ended, and answers none of those that come meanwhile (Ray 2.60: ray#64405). A call
that never ends (a ``finished`` asked of a standby no session reached, a loop held by a
call that blocks, an ``atexit`` hook stuck on a silent GCS) kept the process for ever: a
retired standby stayed alive past a minute in a CI run, silent to three asks, and a
session's actor or a work's watcher would hold its name as long. ``end_by`` is armed
by an actor that has decided to exit, once what it must do first is done (its session
or its work's outcome in storage and delivered): what the grace cuts short is a close of
connections, a call whose caller gave up, or a kill still queued (``actors.named``; the
actor it was for is found silent and killed again by whoever looks for it next).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

import ray

log = logging.getLogger(__name__)

_ending: threading.Timer | None = None


def end_by(grace_s: float, what: str) -> None:
    """End this process ``grace_s`` from now if it is still here. A thread, not a task:
    it ends the process when the actor's loop itself is held. Armed once; not at all
    outside an actor's process. Never raises: the exit it guards goes on either way."""
    global _ending
    try:
        if _ending is not None or not ray.is_initialized():
            return
        if ray.get_runtime_context().get_actor_id() is None:
            return  # a driver's process: nothing of Ray's to wait for
        timer = threading.Timer(grace_s, _ended, args=(grace_s, what))
        timer.daemon = True
        timer.start()
        _ending = timer
    except Exception:  # a thread that cannot start: Ray's own exit is all there is
        log.warning("%s: no deadline on its exit", what, exc_info=True)


def _ended(grace_s: float, what: str) -> None:
    log.warning(
        "%s (pid %d) still running %g s after it began to exit (a call it runs, or its"
        " close, held it): its process ends now",
        what,
        os.getpid(),
        grace_s,
    )
    # ``os._exit`` flushes nothing: what is buffered for Ray's log files goes first.
    for stream in [h for lg in (log, logging.getLogger()) for h in lg.handlers]:
        with contextlib.suppress(Exception):
            stream.flush()
    for out in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            out.flush()
    os._exit(0)
