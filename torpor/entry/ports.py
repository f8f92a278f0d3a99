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

QUIET_PORTS = range(20000, 32768)


def quiet_port(rng: random.Random | None = None) -> int:
    """A port between 20000 and 32767 that is free now."""
    pick = rng or random.Random()  # noqa: S311 - a port number, not a secret
    for _ in range(200):
        port = pick.randrange(QUIET_PORTS.start, QUIET_PORTS.stop)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: another
            return port
    raise SystemExit("torpor: no free port between 20000 and 32767")
