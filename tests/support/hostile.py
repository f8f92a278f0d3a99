"""A hostile HTTP endpoint, as any tenant's ``callback_url`` may be, for fault tests.

It speaks raw bytes over a real socket so it can misbehave the ways a real server can:

* ``/garbage``: answers a status line that is not HTTP at all;
* ``/drip``: answers one byte every ``drip_every_s`` seconds, for minutes (until closed);
* ``/drip-body``: answers its status and headers at once, then a body with no length
  (it ends where the connection does) one byte every ``drip_every_s`` seconds;
* ``/redirect-local`` and ``/redirect-metadata``: a 302 to ``127.0.0.1`` (this very server's
  ``/internal``, so following it would show up in ``hits``) or to the cloud metadata
  address ``169.254.169.254``;
* ``/hold``: answers 200 once ``release`` is set;
* ``/endless-line``: answers a stream whose line never ends (4 MiB with no newline);
* anything else: ``200``.

``Hanging`` is a name resolver that does not answer.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HostileServer:
    drip_every_s: float = 0.25
    hits: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                path = server._read_request(sock)
                server.hits.append(path)
                server._answer(sock, path)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                return  # a client that hangs up on a hostile server is the normal case

        self._tcp = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._tcp.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self._tcp.server_address[1]}"

    def url(self, path: str) -> str:
        return self.base + path

    def _read_request(self, sock: socket.socket) -> str:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(
            (
                int(v)
                for k, _, v in (x.partition(":") for x in lines[1:])
                if k.lower() == "content-length"
            ),
            0,
        )
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return lines[0].split(" ")[1] if " " in lines[0] else ""

    def _answer(self, sock: socket.socket, path: str) -> None:
        if path == "/garbage":
            sock.sendall(b"EHLO this is not http\r\n\r\n")
        elif path == "/drip":
            # A long header: dripped, it would take minutes to finish.
            answer = b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 4096 + b"\r\nContent-Length: 0\r\n\r\n"
            self._drip(sock, answer)
        elif path == "/drip-body":
            sock.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            self._drip(sock, b'{"answer": "' + b"a" * 4096 + b'"}')
        elif path == "/redirect-local":
            self._status(sock, "302 Found", f"Location: {self.base}/internal\r\n")
        elif path == "/redirect-metadata":
            location = "http://169.254.169.254/latest/meta-data/"
            self._status(sock, "302 Found", f"Location: {location}\r\n")
        elif path == "/endless-line":
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
            sock.sendall(b"Connection: close\r\n\r\ndata: ")
            for _ in range(64):
                try:
                    sock.sendall(b"a" * 65536)
                except OSError:  # the client stopped reading: the normal end
                    return
        elif path == "/hold":
            self.release.wait(30)
            self._status(sock, "200 OK")
        else:
            self._status(sock, "200 OK")

    def _drip(self, sock: socket.socket, data: bytes) -> None:
        for byte in data:
            if self.closed.wait(self.drip_every_s):
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return

    @staticmethod
    def _status(sock: socket.socket, status: str, headers: str = "") -> None:
        sock.sendall(f"HTTP/1.1 {status}\r\n{headers}Content-Length: 0\r\n\r\n".encode())

    def close(self) -> None:
        self.closed.set()
        self.release.set()
        self._tcp.shutdown()
        self._tcp.server_close()


class Hanging:
    """A resolver (``socket.getaddrinfo``) for ``hang.test`` that answers 127.0.0.1 only
    once ``release`` is set (after 5 s at the latest: a failing run ends); other names
    resolve for real."""

    def __init__(self) -> None:
        self.real = socket.getaddrinfo
        self.release = threading.Event()
        self.answered = threading.Event()

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hang.test":
            return self.real(host, port, *args, **kwargs)
        self.release.wait(5)
        self.answered.set()
        return self.real("127.0.0.1", port, *args, **kwargs)
