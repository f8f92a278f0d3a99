"""The outbound HTTP helper against a real local HTTP server."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.hostile import Hanging, HostileServer
from torpor import outbound
from torpor.errors import OutboundBusy, ResponseTooLarge, UnsafeUrl
from torpor.outbound import request, request_async, retry_after_s, stream_lines
from torpor.ssrf import vetted_address
from torpor.threads import ProcessPool

BIG = 64 * 1024


@dataclass
class Server:
    """Routes: /ok, /slow (answers once released), /redirect, /big, /throttle, /events."""

    paths: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    retry_after: str = "120"

    def __post_init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes, **headers: str) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name.replace("_", "-"), value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                server.paths.append(self.path)
                if self.path == "/slow":
                    server.release.wait(timeout=10)  # held until the test lets go
                    self._answer(200, b"late")
                elif self.path == "/redirect":
                    self._answer(302, b"", Location="/ok")
                elif self.path == "/big":
                    self._answer(200, b"x" * BIG)
                elif self.path == "/throttle":
                    self._answer(429, b'{"error": "slow down"}', Retry_After=server.retry_after)
                elif self.path == "/events":
                    self._answer(200, b"id: 1\ndata: one\n\nid: 2\ndata: two\n\n")
                else:
                    self._answer(200, b'{"ok": true}', X_Trace="abc")

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                server.paths.append(f"POST {self.path} {self.rfile.read(length).decode()}")
                self._answer(404, b'{"title": "Not found"}')

            def log_message(self, *args: object) -> None:
                return

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}{path}"

    def close(self) -> None:
        self.release.set()
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_a_2xx_answer_carries_status_body_and_lower_case_headers(server: Server) -> None:
    response = request("GET", server.url("/ok"), timeout_s=5)
    assert response.ok and response.status == 200
    assert response.json() == {"ok": True}
    assert response.header("X-Trace") == "abc" and response.headers["x-trace"] == "abc"


def test_an_error_status_is_an_answer_not_an_exception(server: Server) -> None:
    response = request("POST", server.url("/hook"), body=b"hello", timeout_s=5)
    assert response.status == 404 and not response.ok
    assert response.json() == {"title": "Not found"}
    assert server.paths == ["POST /hook hello"]


def test_a_silent_server_times_out(server: Server) -> None:
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        request("GET", server.url("/slow"), timeout_s=0.2)
    server.release.set()


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    s = HostileServer()
    yield s
    s.close()


def test_a_dripping_server_is_cut_at_the_overall_deadline(hostile: HostileServer) -> None:
    # Each byte comes well within the deadline, so a per-read timeout never fires.
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        request("POST", hostile.url("/drip"), body=b"{}", timeout_s=1.0)
    assert time.monotonic() - started < 4.0


async def test_a_dripping_server_cuts_the_async_form_too(hostile: HostileServer) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await request_async("POST", hostile.url("/drip"), body=b"{}", timeout_s=1.0)
    assert time.monotonic() - started < 4.0


def test_a_body_cut_at_the_deadline_is_a_timeout_not_a_short_answer(
    hostile: HostileServer,
) -> None:
    """A body with no Content-Length ends where the connection does, and the deadline's
    cut of the socket reads as that end: the bytes read so far came back as a whole 200."""
    with pytest.raises(TimeoutError):
        request("GET", hostile.url("/drip-body"), timeout_s=1.0)


def test_a_garbage_status_line_is_a_protocol_error(hostile: HostileServer) -> None:
    with pytest.raises(http.client.HTTPException):
        request("POST", hostile.url("/garbage"), body=b"{}", timeout_s=5)


def test_a_redirect_is_answered_not_followed(server: Server) -> None:
    response = request("GET", server.url("/redirect"), timeout_s=5)
    assert response.status == 302 and response.header("Location") == "/ok"
    assert server.paths == ["/redirect"], "the Location was never requested"


def test_a_body_past_the_cap_is_refused(server: Server) -> None:
    with pytest.raises(ResponseTooLarge):
        request("GET", server.url("/big"), timeout_s=5, max_body_bytes=BIG - 1)
    assert len(request("GET", server.url("/big"), timeout_s=5, max_body_bytes=BIG).body) == BIG


def test_a_zero_cap_leaves_the_body_unread(server: Server) -> None:
    response = request("GET", server.url("/big"), timeout_s=5, max_body_bytes=0)
    assert response.status == 200 and response.body == b""


def test_only_http_urls_are_called() -> None:
    with pytest.raises(UnsafeUrl):
        request("GET", "file:///etc/passwd", timeout_s=5)


async def test_the_async_form_runs_the_same_request(server: Server) -> None:
    response = await request_async("GET", server.url("/redirect"), timeout_s=5)
    assert response.status == 302 and server.paths == ["/redirect"]


def test_retry_after_in_seconds_from_the_server(server: Server) -> None:
    response = request("GET", server.url("/throttle"), timeout_s=5)
    assert response.status == 429
    now = datetime.now(UTC)
    assert retry_after_s(response.header("Retry-After"), now=now) == 120.0
    assert retry_after_s(response.header("Retry-After"), now=now, cap_s=60) == 60.0


def test_retry_after_as_an_http_date_from_the_server(server: Server) -> None:
    now = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    server.retry_after = format_datetime(now + timedelta(seconds=90), usegmt=True)
    response = request("GET", server.url("/throttle"), timeout_s=5)
    assert response.header("Retry-After") == "Sun, 01 Mar 2026 12:01:30 GMT"
    assert retry_after_s(response.header("Retry-After"), now=now) == 90.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("soon", None),
        ("-5", None),
        ("nan", None),
        ("1.5", None),  # delay-seconds is 1*DIGIT (RFC 9110)
        (" 7 ", 7.0),
        ("Sun, 01 Mar 2026 11:00:00 GMT", 0.0),  # a date in the past: no wait
        # Dates no datetime can hold: the stdlib parser raises OverflowError for them.
        ("Sun, 01 Mar 2026 11:00:00 +99999999999999999999", None),
        ("Sun, 01 Mar 99999999999999999999 11:00:00 GMT", None),
        ("Sun, 01 Mar 2026 99999999999999999999:00:00 GMT", None),
    ],
)
def test_retry_after_values(value: str | None, expected: float | None) -> None:
    now = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_s(value, now=now) == expected


def test_a_stream_is_read_line_by_line(server: Server) -> None:
    with stream_lines(server.url("/events"), timeout_s=5) as (status, lines):
        data = [line for line in lines if line.startswith(b"data: ")]
    assert status == 200 and data == [b"data: one\n", b"data: two\n"]


def test_a_stream_line_past_the_cap_is_refused(hostile: HostileServer) -> None:
    """A line was read whole however long it was: a server that never sent a newline
    grew the CLI's memory (``torpor events``) until it ran out."""
    with stream_lines(hostile.url("/endless-line"), timeout_s=5) as (status, lines):
        assert status == 200
        with pytest.raises(ResponseTooLarge):
            next(lines)


def test_there_is_one_retry_after_parser() -> None:
    import torpor.agents.openai_agent as openai_agent
    import torpor.notify as notify

    assert not hasattr(notify, "retry_after_s") and not hasattr(openai_agent, "_retry_after")
    assert openai_agent.retry_after_s is outbound.retry_after_s


async def test_stuck_threads_of_the_default_executor_do_not_hold_calls_out(
    server: Server,
) -> None:
    """Sync tools stuck past their deadline keep their threads of asyncio's default
    executor (nothing stops a thread): calls out queued behind them, LLM steps and
    deliveries of the whole process included, their own deadlines not even started."""
    loop = asyncio.get_running_loop()
    release = threading.Event()
    stuck = [loop.run_in_executor(None, release.wait) for _ in range(64)]
    try:
        answer = await asyncio.wait_for(
            request_async("GET", server.url("/redirect"), timeout_s=5), timeout=10
        )
        assert answer.status == 302
    finally:
        release.set()
        await asyncio.gather(*stuck)


async def test_a_resolver_that_does_not_answer_is_cut_at_the_deadline() -> None:
    """The delivery attempt's deadline covers the name's resolution too."""
    release = threading.Event()

    def silent(*_: object, **__: object) -> list[tuple[object, ...]]:
        release.wait()
        return []

    try:
        with pytest.raises(socket.gaierror, match="no DNS answer"):
            await vetted_address(
                "http://hooks.example/", allow_private=False, timeout_s=0.2, resolve=silent
            )
    finally:
        release.set()


async def test_the_wait_for_an_outbound_thread_counts_against_the_deadline(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every outbound thread busy (slow LLM calls) held a call for as long as they
    lasted, its deadline not even started; given up on, it must never be sent later."""
    monkeypatch.setattr(outbound, "OUTBOUND", ProcessPool(1, "test-outbound"))
    release = threading.Event()
    busy = asyncio.ensure_future(outbound.OUTBOUND.run(release.wait))
    asyncio.get_running_loop().call_later(5, release.set)  # a failing wait ends, at least
    try:
        with pytest.raises(OutboundBusy):
            await request_async("POST", server.url("/hook"), body=b"late", timeout_s=0.3)
        assert not release.is_set(), "the call waited for the busy thread"
    finally:
        release.set()
        await busy
    # The one thread runs queued calls in order: the call given up on came before this.
    await outbound.OUTBOUND.run(lambda: None)
    assert server.paths == [], "a call given up on was sent once a thread was free"


def test_an_unpinned_request_is_cut_at_its_deadline_while_its_host_resolves(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name was resolved inside the socket's connect, where no timeout and no
    watchdog reach: a resolver that did not answer held the request, and its thread, for
    as long as it liked."""
    resolver = Hanging()
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    try:
        with pytest.raises(TimeoutError):
            request("GET", server.url("/ok").replace("127.0.0.1", "hang.test"), timeout_s=0.3)
        assert not resolver.answered.is_set(), "the request waited for the resolver"
    finally:
        resolver.release.set()
