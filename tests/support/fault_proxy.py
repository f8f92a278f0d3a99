"""A fault-injecting HTTP proxy, put in front of the S3 test server (or any HTTP peer).

Each request is matched against the armed faults, first match wins, each fault firing a
set number of times:

* ``fail(status, code)``: answer at once with an S3-style XML error, forward nothing
  (503 SlowDown bursts, 409 ConditionalRequestConflict); with ``code=""``, the status
  alone and no body (a gateway or proxy in front of the store answering for it);
* ``delay(seconds)``: forward after a pause;
* ``reset_after_commit()``: forward the request, let the upstream commit it, read its
  answer, then reset the client's connection instead of answering. The client's retry
  meets its own earlier write: the ambiguous-write case ("412 on a PUT that landed");
* ``strip_conditions()``: forward without ``If-None-Match``/``If-Match``, like a store or
  gateway that ignores conditional writes; ``strip_headers(*names)`` any other headers
  (``Range``: a gateway that answers a ranged GET with the whole object).

It speaks HTTP/1.1 with keep-alive so boto3's connection pool works through it, and
counts what it did, so tests can assert that a fault really fired.
"""

from __future__ import annotations

import http.client
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

Match = Callable[[str, str, dict[str, str]], bool]


def any_request(method: str, path: str, headers: dict[str, str]) -> bool:
    return True


def conditional_put(method: str, path: str, headers: dict[str, str]) -> bool:
    """A create-only or compare-and-swap PUT (the writes whose answer must not be lost)."""
    return method == "PUT" and ("if-none-match" in headers or "if-match" in headers)


def method_is(*methods: str) -> Match:
    wanted = {m.upper() for m in methods}
    return lambda method, path, headers: method in wanted


def path_contains(fragment: str, *methods: str) -> Match:
    wanted = {m.upper() for m in methods}
    return lambda method, path, headers: fragment in path and (not wanted or method in wanted)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # A client that vanished mid-request (a killed process: the point of the faults)
        # is expected here; anything else is still printed.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


@dataclass
class Fault:
    kind: str  # "fail" | "delay" | "reset" | "strip"
    match: Match
    times: int
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    fired: int = 0
    headers: frozenset[str] = frozenset({"if-none-match", "if-match"})  # what "strip" drops


@dataclass
class ProxyStats:
    forwarded: int = 0
    failed: int = 0
    delayed: int = 0
    reset: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, what)


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.stats = ProxyStats()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- arming -------------------------------------------------------------------------

    def fail(
        self,
        status: int = 503,
        code: str = "SlowDown",
        *,
        times: int = 1,
        match: Match | None = None,
    ) -> Fault:
        return self._arm(Fault("fail", match or any_request, times, status=status, code=code))

    def delay(self, seconds: float, *, times: int = 1, match: Match | None = None) -> Fault:
        return self._arm(Fault("delay", match or any_request, times, seconds=seconds))

    def reset_after_commit(self, *, times: int = 1, match: Match | None = None) -> Fault:
        return self._arm(Fault("reset", match or conditional_put, times))

    def strip_conditions(self, *, times: int = 1_000_000, match: Match | None = None) -> Fault:
        return self._arm(Fault("strip", match or conditional_put, times))

    def strip_headers(
        self, *names: str, times: int = 1_000_000, match: Match | None = None
    ) -> Fault:
        dropped = frozenset(n.lower() for n in names)
        return self._arm(Fault("strip", match or any_request, times, headers=dropped))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def _arm(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def _take(self, method: str, path: str, headers: dict[str, str]) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.fired < fault.times and fault.match(method, path, headers):
                    fault.fired += 1
                    return fault
        return None

    # -- serving ------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                return

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _serve(self) -> None:
                method, path = self.command, self.path
                headers = {k.lower(): v for k, v in self.headers.items()}
                body = self._body()
                fault = proxy._take(method, path, headers)
                if fault is not None and fault.kind == "fail":
                    proxy._record(method, path, f"fail {fault.status}")
                    self._error(fault.status, fault.code)
                    return
                if fault is not None and fault.kind == "delay":
                    proxy._record(method, path, f"delay {fault.seconds}")
                    time.sleep(fault.seconds)
                if fault is not None and fault.kind == "strip":
                    proxy._record(method, path, "strip conditions")
                    headers = {k: v for k, v in headers.items() if k not in fault.headers}
                status, reason, out_headers, data = proxy._forward(method, path, headers, body)
                if fault is not None and fault.kind == "reset":
                    proxy._record(method, path, f"reset after {status}")
                    self._reset()
                    return
                proxy._record(method, path, f"forwarded {status}")
                self.send_response(status, reason)
                for name, value in out_headers:
                    if name.lower() not in {"transfer-encoding", "connection", "content-length"}:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, code: str) -> None:
                if not code:  # the status line alone, as a proxy in front of S3 answers
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                payload = (
                    f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f"<Message>injected fault</Message></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _reset(self) -> None:
                # SO_LINGER 0 turns close() into a TCP RST: the client sees "connection
                # reset by peer", never a status line.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler

    def _record(self, method: str, path: str, what: str) -> None:
        with self._lock:
            self.stats.log.append((method, path, what))
            head = what.split()[0]
            if head == "fail":
                self.stats.failed += 1
            elif head == "delay":
                self.stats.delayed += 1
                self.stats.forwarded += 1
            elif head == "strip":
                return
            elif head == "reset":
                self.stats.reset += 1
                self.stats.forwarded += 1
            else:
                self.stats.forwarded += 1

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=30)
        try:
            sent = {
                k: v for k, v in headers.items() if k not in {"transfer-encoding", "connection"}
            }
            sent["content-length"] = str(len(body))
            conn.request(
                method, path, body=body if body or method in {"PUT", "POST"} else None, headers=sent
            )
            response = conn.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()
