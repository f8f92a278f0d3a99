"""A watchdog for a bench's event loop: a loop blocked for long is printed with where.

A bench that overruns its caller's deadline is killed with nothing said of why. A loop
blocked in one synchronous call (a GCS lookup, a lock) and a loop busy retrying look
the same from outside; this tells them apart. A thread asks the loop to answer every
``every_s``; one that has not answered for ``after_s`` has its thread's stack printed
(once per stall), to stdout, where the bench's own notes are.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable


def _print(report: str) -> None:
    print(report, flush=True)


def watch(
    loop: asyncio.AbstractEventLoop,
    *,
    after_s: float = 10.0,
    every_s: float = 1.0,
    say: Callable[[str], None] = _print,
) -> None:
    """Watch ``loop`` (run on the calling thread) until the process exits; a stall is
    handed to ``say`` (from the watchdog's thread), stdout by default."""
    owner = threading.get_ident()
    answered = [time.monotonic()]

    def pong() -> None:
        answered[0] = time.monotonic()

    def run() -> None:
        said = False
        while not loop.is_closed():
            try:
                loop.call_soon_threadsafe(pong)
            except RuntimeError:  # closed meanwhile
                return
            time.sleep(every_s)
            blocked = time.monotonic() - answered[0]
            if blocked < after_s:
                said = False
                continue
            if said:
                continue
            said = True
            frame = sys._current_frames().get(owner)
            stack = "".join(traceback.format_stack(frame)[-12:]) if frame else "(gone)\n"
            say(f"event loop blocked {blocked:.0f}s, in:\n{stack}")

    threading.Thread(target=run, name="loop-watchdog", daemon=True).start()
