"""An actor's process that is exiting ends within a grace, whatever holds it.

Ray lets an async actor that called ``exit_actor`` go only once every call it is running
has ended, and answers none of those that come meanwhile (Ray 2.60: ray#64405). A call
that never ends (a ``finished`` asked of a standby no session reached, a loop held by a
call that blocks, an ``atexit`` hook stuck on a silent GCS) kept the process for ever: a
retired standby stayed alive past a minute in a CI run, silent to three asks, and a
session's actor or a work's watcher would hold its name as long. ``end_by`` is armed
by an actor that has decided to exit, once what it must do first is done (its session
in storage, its services closed): nothing is lost by ending it sooner than Ray would.
"""

from __future__ import annotations

import logging
import os
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
        "%s (pid %d) still running %g s after its exit: calls still running held it;"
        " its process ends now",
        what,
        os.getpid(),
        grace_s,
    )
    os._exit(0)
