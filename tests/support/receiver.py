"""A real HTTP endpoint that receives torpor's outbound notifications in tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers each POST with the next status in ``script`` (the last one repeats).
    With ``hold``, each POST is recorded at once but answered only once the test
    releases ``hold`` for it: a receiver as slow as the test says."""

    script: list[int] = field(default_factory=lambda: [200])
    retry_after: str | None = None
    hold: threading.Semaphore | None = None
    received: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                receiver.received.append(
                    Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                index = min(len(receiver.received) - 1, len(receiver.script) - 1)
                if receiver.hold is not None:
                    receiver.hold.acquire(timeout=10)  # bounded: a failing run ends
                self.send_response(receiver.script[index])
                if receiver.retry_after:
                    self.send_header("Retry-After", receiver.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def receiver(script: list[int] | None = None, retry_after: str | None = None) -> Iterator[Receiver]:
    r = Receiver(script or [200], retry_after)
    try:
        yield r
    finally:
        r.close()
