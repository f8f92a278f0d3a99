"""Ports to listen on, chosen where no other process takes them unasked.

A port the kernel hands out (a bind to port 0) is free when chosen, but until the
server it was chosen for binds it, any process's next outgoing connection may take it
as its source port: Ray's own processes bind ephemeral ports as they start, and every
Redis client connection takes one. So ports are drawn from below the kernel's ephemeral
range (32768 and up on Linux) and above Ray's worker ports (10002-19999).
"""

from __future__ import annotations

import random
import socket
import threading

QUIET_PORTS = range(20000, 32768)
# Handed out by this process: one chosen but not bound yet is free to a second call, and
# two servers started together (the demo's, a test's) were given the same port.
_given: set[int] = set()
_giving = threading.Lock()


def quiet_port(rng: random.Random | None = None) -> int:
    """A port between 20000 and 32767 that is free now, and not one this process handed
    out before."""
    pick = rng or random.Random()  # noqa: S311 - a port number, not a secret
    for _ in range(200):
        port = pick.randrange(QUIET_PORTS.start, QUIET_PORTS.stop)
        with _giving:
            if port in _given:
                continue
            _given.add(port)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: another
            return port
    raise SystemExit("torpor: no free port between 20000 and 32767")
