"""Named crash points for the fault-injection suite.

``crash_point(name)`` kills the current process with SIGKILL, at once and without any
cleanup, when the comma-separated environment variable ``TORPOR_CRASH_AT`` names it. The
variable is read once, at the first crash point a process passes (not at import: importing
the app reads no environment). In production it is unset and a crash point costs one set
lookup. Tests start a real process with the variable set and watch what survives.
"""

from __future__ import annotations

import functools
import os
import signal


@functools.cache
def _armed() -> frozenset[str]:
    names = os.environ.get("TORPOR_CRASH_AT", "").split(",")
    return frozenset(name.strip() for name in names if name.strip())


def crash_point(name: str) -> None:
    """SIGKILL this process here if ``TORPOR_CRASH_AT`` names ``name``."""
    if name in _armed():
        os.kill(os.getpid(), signal.SIGKILL)
