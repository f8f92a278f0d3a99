"""Every HTTP request torpor makes goes through here: one deadline, no redirects, a
capped response body.

stdlib only (``torpor`` depends on nothing but pydantic), blocking: async callers run it
in threads of their own (``request_async``). A 3xx is answered as it is, never
followed: urllib would otherwise replay the request, ``Authorization`` header included,
against wherever the ``Location`` points. Non-2xx statuses are answers, not exceptions;
transport failures raise ``OSError`` (a refused connection, a timeout as ``TimeoutError``
or ``URLError``) or ``http.client.HTTPException`` (a garbled answer), unchanged.

``timeout_s`` of ``request`` is an *overall* deadline, the host name's resolution
included, not a per-socket one: a watchdog shuts the connection's socket down when it
passes, so a server that drips one byte every few seconds is cut at the deadline
(``TimeoutError``) instead of holding the caller and its worker thread for as long as it
likes.

``connect_to`` pins the connection to addresses vetted beforehand (``torpor.ssrf``):
the socket dials those (the next when one fails) instead of resolving the URL's host
again, while the ``Host`` header, TLS SNI and the certificate check keep the URL's host
name.

``retry_after_s`` reads a ``Retry-After`` header in both of its forms.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.message import Message
from email.utils import parsedate_to_datetime
from functools import partial
from typing import IO, Any
from urllib.parse import urlsplit

from torpor.errors import OutboundBusy, ResponseTooLarge, UnsafeUrl
from torpor.threads import ProcessPool

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# Where a pinned request connects (``connect_to``): one vetted address, or several tried
# in order (``torpor.ssrf.vet_callback_url``).
Pinned = str | tuple[str, ...]


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Message,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None  # urllib then surfaces the 3xx as the answer


_OPENER = urllib.request.build_opener(_RefuseRedirects)


class _Deadline:
    """Shuts down every socket of one request when its deadline passes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def remaining(self) -> float:
        left = self._at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete answer within {self.seconds:g} s")
        return left

    @property
    def passed(self) -> bool:
        # Also before the timer has run: a resolution cut at the deadline may fail first.
        return self.expired or time.monotonic() >= self._at

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        # Wakes a read blocked in another thread; the request then fails and the caller
        # sees TimeoutError.
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _deadline_connection(
    base: type[http.client.HTTPConnection], deadline: _Deadline, connect_to: Pinned | None
) -> type[http.client.HTTPConnection]:
    class Connection(base):  # type: ignore[valid-type, misc]
        def connect(self) -> None:
            self.timeout = deadline.remaining()  # no single read outlasts the deadline
            if connect_to is not None:
                # http.client dials through this hook; self.host stays the URL's host, so
                # the Host header and (HTTPS) server_hostname for SNI and the certificate
                # check are unchanged. Only the address dialled is the vetted one.
                self._create_connection = partial(_dial, connect_to, deadline=deadline)
            else:
                self._create_connection = partial(_dial_resolved, deadline)
            super().connect()
            deadline.watch(self.sock)

    return Connection


def _dial(
    addresses: Pinned,
    host_port: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
    *,
    deadline: _Deadline | None = None,
) -> socket.socket:
    """The first of the vetted addresses that answers, in order, as an unpinned
    ``create_connection`` tries those the name resolves to; the last failure if none.
    With a ``deadline`` each try has what is left of it, not a whole ``timeout`` of its
    own: three addresses that never answer would have held the request three times its
    deadline before the watchdog had a socket to cut."""
    failure: OSError | None = None
    for address in (addresses,) if isinstance(addresses, str) else addresses:
        left = timeout if deadline is None else deadline.remaining()
        try:
            return socket.create_connection((address, host_port[1]), left, source_address)
        except OSError as exc:
            failure = exc
    raise failure or OSError("no address to connect to")


# Names of unpinned requests are resolved in threads of their own. Resolved inside the
# socket's connect, as create_connection does, a name was beyond every deadline: no
# socket timeout bounds getaddrinfo and there is no socket yet for the watchdog to cut.
# A resolver that does not answer holds one of these threads, not the caller's.
NAMES = ProcessPool(16, "torpor-outbound-dns")


def _dial_resolved(
    deadline: _Deadline,
    host_port: tuple[str, int],
    timeout: float | None = None,
    source_address: tuple[str, int] | None = None,
) -> socket.socket:
    """``create_connection``, the name resolved within the request's deadline."""
    host, port = host_port
    left = deadline.remaining()
    resolving = NAMES.executor().submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        infos = resolving.result(timeout=left)
    except TimeoutError:
        resolving.cancel()  # not started: it never will be
        raise TimeoutError(f"no DNS answer for {host!r} within {deadline.seconds:g} s") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    return _dial(addresses, host_port, timeout, source_address, deadline=deadline)


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline, connect_to: Pinned | None) -> None:
        super().__init__()
        self._connection = _deadline_connection(http.client.HTTPConnection, deadline, connect_to)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline, connect_to: Pinned | None) -> None:
        super().__init__()
        self._connection = _deadline_connection(http.client.HTTPSConnection, deadline, connect_to)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._connection, req)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lower case

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self) -> Any:
        """The body as JSON (``None`` for an empty body); ``ValueError`` if it is not."""
        return json.loads(self.body or b"null")


def _open(
    method: str,
    url: str,
    body: bytes | None,
    headers: Mapping[str, str] | None,
    timeout_s: float,
    deadline: _Deadline | None = None,
    connect_to: Pinned | None = None,
) -> Any:
    if urlsplit(url).scheme not in ("http", "https"):
        raise UnsafeUrl("only http(s) URLs are called")
    request = urllib.request.Request(url, data=body, headers=dict(headers or {}), method=method)  # noqa: S310 - http(s) checked above
    opener = _OPENER
    if deadline is not None:
        handlers: list[Any] = [
            _RefuseRedirects,
            _DeadlineHTTP(deadline, connect_to),
            _DeadlineHTTPS(deadline, connect_to),
        ]
        if connect_to is not None:
            # A pinned request dials the vetted address itself. Through a proxy from the
            # environment (HTTP_PROXY) it dialled the vetted address at the proxy's port,
            # and failed; and a proxy would resolve the name again, unvetted. Direct.
            handlers.append(urllib.request.ProxyHandler({}))
        opener = urllib.request.build_opener(*handlers)
    try:
        return opener.open(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        return exc  # an answer (4xx, 5xx, or a 3xx not followed), with its body and headers


def _read(stream: IO[bytes], limit: int) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise ResponseTooLarge(f"the response exceeds {limit} bytes", limit=limit)
    return data


def request(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    connect_to: Pinned | None = None,
) -> Response:
    """One blocking request. ``timeout_s`` is its overall deadline, from connect to the
    last byte read (``TimeoutError`` past it); a body past ``max_body_bytes`` raises
    ``ResponseTooLarge``; ``max_body_bytes=0`` leaves the body unread (the status is all
    the caller wants); ``connect_to`` dials that address (those, in order) instead of
    resolving the host."""
    with _Deadline(timeout_s) as deadline:
        try:
            with _open(method, url, body, headers, timeout_s, deadline, connect_to) as response:
                data = _read(response, max_body_bytes) if max_body_bytes > 0 else b""
                if max_body_bytes > 0 and deadline.expired:
                    # A body with no length ends where the connection does, and the cut
                    # socket reads as that end: what came so far is no complete answer.
                    # (Unread, the body cannot be short: a status read in time stands.)
                    raise TimeoutError(f"no complete answer within {timeout_s:g} s")
                found = {k.lower(): v for k, v in (response.headers or {}).items()}
                return Response(int(response.status or response.code), data, found)
        except (OSError, http.client.HTTPException) as exc:
            if deadline.passed:  # whatever the cut socket raised, the cause is the deadline
                raise TimeoutError(f"no complete answer within {timeout_s:g} s") from exc
            raise


# Calls out get threads of their own (``torpor.threads``): in asyncio's default executor
# a few sync tools stuck past their deadline, whose threads cannot be stopped, left every
# LLM step, approval request and delivery of the process queued behind them, their own
# deadlines not even started.
OUTBOUND = ProcessPool(32, "torpor-outbound")


class _Claim:
    """Who comes first to a queued call: a thread taking it, or its caller giving up the
    wait. Decided under a lock, so a thread that starts as the caller gives up never
    sends what the caller has already reported as not sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: str | None = None

    def take(self) -> bool:
        return self._first("thread")

    def give_up(self) -> bool:
        return self._first("caller")

    def _first(self, who: str) -> bool:
        with self._lock:
            if self._by is None:
                self._by = who
            return self._by == who


async def request_async(
    method: str,
    url: str,
    *,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout_s: float,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    connect_to: Pinned | None = None,
) -> Response:
    """``request`` in an outbound thread, ``timeout_s`` counted from this call: the wait
    for a free thread is part of it (``OutboundBusy``, nothing sent, when none is free
    within it) and the request has what is left. A cancelled caller leaves a thread that
    took the call to finish within the deadline (it cuts the request there)."""
    queued = time.monotonic()
    claim = _Claim()

    def call() -> Response:
        if not claim.take():  # the caller stopped waiting: it was told nothing was sent
            raise OutboundBusy("the caller stopped waiting for an outbound thread")
        left = timeout_s - (time.monotonic() - queued)
        if left <= 0:
            raise TimeoutError(f"no complete answer within {timeout_s:g} s")
        return request(
            method,
            url,
            body=body,
            headers=headers,
            timeout_s=left,
            max_body_bytes=max_body_bytes,
            connect_to=connect_to,
        )

    # Waiting for a thread without a bound let the 32 threads' slow calls (LLM steps)
    # hold a delivery attempt past its deadline and its timer's lease: another process
    # then took the timer and posted the same delivery again.
    running = asyncio.ensure_future(OUTBOUND.run(call))
    try:
        await asyncio.wait({running}, timeout=timeout_s)
    except BaseException:  # cancelled: a call no thread took yet is never made
        if claim.give_up():
            running.cancel()
        raise
    if not running.done() and claim.give_up():
        running.cancel()
        raise OutboundBusy(f"no outbound thread was free within {timeout_s:g} s")
    return await running


@contextmanager
def stream_lines(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    timeout_s: float,
    max_line_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Iterator[tuple[int, Iterator[bytes]]]:
    """A GET whose body is read line by line as it arrives (Server-Sent Events):
    ``timeout_s`` bounds each read, so a server gone silent ends the stream; a line
    longer than ``max_line_bytes`` raises ``ResponseTooLarge``."""
    with _open("GET", url, None, headers, timeout_s) as response:
        status = int(response.status or response.code)
        yield status, _lines(response, max_line_bytes)


def _lines(stream: IO[bytes], limit: int) -> Iterator[bytes]:
    # A line read with no limit grew for as long as the server sent no newline, until
    # the reader (``torpor events``) ran out of memory.
    while line := stream.readline(limit + 1):
        if len(line) > limit:
            raise ResponseTooLarge(f"a line of the stream exceeds {limit} bytes", limit=limit)
        yield line


def retry_after_s(value: str | None, *, now: datetime, cap_s: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks for: delta-seconds or an HTTP date (a date in
    the past is 0); None if absent or unreadable. Capped at ``cap_s`` when given."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # RFC 9110 delay-seconds: 1*DIGIT, nothing else
        seconds = float(value)
    else:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            # OverflowError: a zone, year or hour no datetime holds (``+99999999999999999999``).
            # Raised, it failed a delivery's attempt after its POST, uncounted, for ever.
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = max(0.0, (when - now).total_seconds())
    return seconds if cap_s is None else min(seconds, cap_s)
