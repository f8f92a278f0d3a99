"""This process as a Ray driver: its connection, and what Ray does to its SIGTERM.

In the main thread ``ray.init`` sets a Python SIGTERM handler (``sys.exit``, so that
``atexit`` work and ``ray.shutdown`` run), then its connect puts abseil's failure-signal
handler in front of whatever handles SIGTERM. That handler prints a stack, hands the
signal on, and arms a three-second ``alarm`` that aborts the process (SIGABRT, a core
dump) if it is still alive then (ray-project/ray#37288). A driver whose exit takes longer,
as stopping the local Ray it started does on a loaded machine, died mid-exit: its
``atexit`` work cut short, exit code -6 where Ray's handler exits 15. Installing the
Python handler again (``signal.signal`` always sets it in the kernel) takes abseil off
SIGTERM alone; it still reports crashes (SIGSEGV, SIGABRT) while Ray is connected. The
abort was also a backstop: an exit that hangs now waits for its orchestrator's SIGKILL,
as any Python program's does.

``ray.shutdown`` puts every one of those signals back to the default in the kernel, a
Python handler included (``signal.getsignal`` still names it): a SIGTERM after it killed
the process outright, past the handler and any cleanup that followed the shutdown.

Only the main thread can set a handler. A connect made from another thread still puts
abseil in front of SIGTERM, with the three-second abort; a program that connects so and
needs a longer exit connects from its main thread, or sets
``RAY_DISABLE_FAILURE_SIGNAL_HANDLER=1`` (no crash reports from Ray then).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def keep_sigterm_in_python() -> None:
    """In the main thread, SIGTERM handled by the Python handler ``signal.getsignal``
    names, alone (abseil's, or the default ``ray.shutdown`` put back, displaced)."""
    if not _main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not None:  # None: set outside Python, not ours to replace
        signal.signal(signal.SIGTERM, handler)


def init_driver(**ray_init: Any) -> None:
    """``ray.init(**ray_init)``. In the main thread SIGTERM then runs a Python handler
    alone: one the program set itself before (SIG_IGN too: it still ignores it), else
    Ray's (exit with the signal's number). A connect that fails leaves the program's
    own handler as it found it."""
    import ray

    own = signal.getsignal(signal.SIGTERM) if _main_thread() else None
    try:
        ray.init(**ray_init)
    finally:
        if own not in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, own)  # over Ray's, and abseil in front of it
        else:
            keep_sigterm_in_python()  # Ray's, or the default of a failed connect


def shutdown_driver() -> None:
    """``ray.shutdown``, then SIGTERM back to the Python handler (``keep_sigterm_in_python``):
    a program that goes on after it (cleanup, another connect) still exits through it."""
    import ray

    try:
        ray.shutdown()
    finally:
        keep_sigterm_in_python()
