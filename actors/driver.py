"""This process as a Ray driver: ``ray.init``, and what Ray does to its SIGTERM.

In the main thread ``ray.init`` sets a Python SIGTERM handler (``sys.exit``, so that
``atexit`` work and ``ray.shutdown`` run), then its connect puts abseil's failure-signal
handler in front of it. That handler prints a stack, hands the signal on, and arms a
three-second ``alarm`` that aborts the process (SIGABRT, a core dump) if it is still
alive then (ray-project/ray#37288). A driver whose exit takes longer, as stopping the
local Ray it started does on a loaded machine, died mid-exit: its ``atexit`` work cut
short, exit code -6 where a container's stop expects 15. Installing the Python handler
again takes abseil off SIGTERM alone; it still reports real crashes (SIGSEGV, SIGABRT).
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def init_driver(**ray_init: Any) -> None:
    """``ray.init(**ray_init)``. In the main thread SIGTERM then runs a Python handler
    alone: one the program set itself before, else Ray's (exit with the signal's number).
    """
    import ray

    main = threading.current_thread() is threading.main_thread()
    own = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**ray_init)
    if not main:
        return  # Ray set no handler, and abseil's is not in front of one we could set
    handler = own if own not in (signal.SIG_DFL, None) else signal.getsignal(signal.SIGTERM)
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)
