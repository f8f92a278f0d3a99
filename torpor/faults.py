"""Named crash points for the fault-injection suite.

``crash_point(name)`` kills the current process with SIGKILL when the comma-separated
environment variable ``TORPOR_CRASH_AT`` (read once, at import) names ``name``; otherwise
it does nothing. Tests start a real process with the variable set, so a crash at that
point is a real one: no ``finally``, no ``atexit``, nothing flushed.
"""

from __future__ import annotations

import os
import signal

_ARMED = frozenset(p.strip() for p in os.environ.get("TORPOR_CRASH_AT", "").split(",") if p.strip())


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``TORPOR_CRASH_AT`` names ``name``."""
    if name in _ARMED:
        os.kill(os.getpid(), signal.SIGKILL)
