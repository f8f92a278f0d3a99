"""A request handler served on a local port for one test: a real HTTP server in a
thread, for the client side (the CLI, outbound calls) to talk to."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer


@contextmanager
def served(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """The server's base URL while the block runs; shut down and closed after it."""
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
