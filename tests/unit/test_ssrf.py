"""The SSRF guard: which addresses may be called, and pinning the vetted address."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from torpor.errors import UnsafeUrl
from torpor.outbound import request
from torpor.ssrf import check_callback, is_public, vet_callback_url

EMBEDDING_PRIVATE = [
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::",  # 6to4 of 169.254.169.254
    "2002:c0a8:101::1",  # 6to4 of 192.168.1.1
    "::7f00:1",  # IPv4-compatible 127.0.0.1
    "::a00:1",  # IPv4-compatible 10.0.0.1
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:169.254.169.254",
    "::ffff:0:a9fe:a9fe",  # SIIT IPv4-translated 169.254.169.254 (RFC 2765)
    "::ffff:0:7f00:1",  # SIIT of 127.0.0.1
    "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215): the operator's own translator
    "64:ff9b:1:0:808:808::",  # ... whatever it embeds, even a public address
    "::1",
    "::",
]


@pytest.mark.parametrize("address", EMBEDDING_PRIVATE)
def test_ipv6_forms_embedding_a_private_ipv4_are_refused(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", ["64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8"])
def test_ipv6_forms_embedding_a_public_ipv4_are_public(address: str) -> None:
    assert is_public(address)


def answering(*addresses: str) -> Any:
    def resolve(host: str, port: int, *args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    return resolve


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1",  # an unclosed bracket
        "http://[zz]/",  # a bracketed host that is no IPv6 address
        "http://\uff03x/",  # a netloc NFKC normalization changes
        "http://a..b/",  # an empty label: IDNA refuses it
        "http://" + "a" * 64 + ".example/",  # a label over 63 characters
    ],
)
@pytest.mark.parametrize("allow_private", [False, True])
async def test_a_malformed_url_is_refused_as_unsafe_not_raised_as_a_value_error(
    url: str, allow_private: bool
) -> None:
    """The standard library raises ValueError (UnicodeError) for these, which reached
    the HTTP edge as a 500; the two IDNA cases only when private addresses are refused
    (the resolver is asked then)."""
    if allow_private and (".." in url or "a" * 64 in url):
        await check_callback(url, allow_private=True, timeout_s=5)  # not resolved: no refusal
        return
    with pytest.raises(UnsafeUrl):
        await check_callback(url, allow_private=allow_private, timeout_s=5)


def test_vetting_returns_the_address_it_checked() -> None:
    url = "https://hooks.example/x"
    assert vet_callback_url(url, allow_private=False, resolve=answering("8.8.8.8")) == ("8.8.8.8",)
    with pytest.raises(UnsafeUrl):
        vet_callback_url(url, allow_private=False, resolve=answering("8.8.8.8", "127.0.0.1"))
    assert vet_callback_url(url, allow_private=True, resolve=answering("127.0.0.1")) is None


def test_vetting_returns_every_address_it_checked_in_order() -> None:
    """A pinned connection dialled the first address only: a host whose first answer
    this machine cannot reach (an IPv6 address without an IPv6 route, a dead node among
    several) failed every attempt, where an unpinned one would try the next."""
    url = "https://hooks.example/x"
    answers = answering("2001:4860:4860::8888", "8.8.8.8", "8.8.8.8", "1.1.1.1")
    assert vet_callback_url(url, allow_private=False, resolve=answers) == (
        "2001:4860:4860::8888",
        "8.8.8.8",
        "1.1.1.1",
    )


async def test_a_failed_resolution_is_not_a_policy_refusal() -> None:
    def again(*args: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    with pytest.raises(socket.gaierror):  # the delivery retries it
        vet_callback_url("http://hooks.example/", allow_private=False, resolve=again)
    with pytest.raises(UnsafeUrl):  # a submission is refused
        await check_callback(
            "http://hooks.example/", allow_private=False, timeout_s=5, resolve=again
        )


@pytest.fixture
def hosts() -> Iterator[tuple[int, list[str]]]:
    """A local server recording the Host header of each request."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Host", ""))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], seen
    server.shutdown()
    server.server_close()


def test_a_pinned_request_dials_the_address_and_keeps_the_host(
    hosts: tuple[int, list[str]],
) -> None:
    port, seen = hosts
    # .invalid never resolves: the request can only arrive through the pinned address.
    url = f"http://callback.invalid:{port}/ok"
    assert request("GET", url, timeout_s=5, connect_to="127.0.0.1").status == 200
    assert seen == [f"callback.invalid:{port}"]


def test_a_pinned_request_tries_the_next_address_when_one_refuses(
    hosts: tuple[int, list[str]],
) -> None:
    port, seen = hosts
    url = f"http://callback.invalid:{port}/ok"
    # 127.0.0.2 is loopback too, where nothing listens on this port: refused at once.
    assert request("GET", url, timeout_s=5, connect_to=("127.0.0.2", "127.0.0.1")).status == 200
    assert seen == [f"callback.invalid:{port}"]
    with pytest.raises(OSError, match="refused"):  # none answers: the last failure
        request("GET", url, timeout_s=5, connect_to=("127.0.0.2", "127.0.0.3"))


def test_a_pinned_request_goes_direct_whatever_proxy_the_environment_names(
    hosts: tuple[int, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through urllib's proxy from the environment it dialled the vetted address at the
    proxy's port (every notification failed), and a proxy resolves the name again."""
    port, seen = hosts
    with socket.socket() as unused:  # a port nothing listens on: the "proxy"
        unused.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{unused.getsockname()[1]}"
    monkeypatch.setenv("http_proxy", proxy)
    monkeypatch.setenv("HTTP_PROXY", proxy)
    url = f"http://callback.invalid:{port}/ok"
    assert request("GET", url, timeout_s=5, connect_to="127.0.0.1").status == 200
    assert seen == [f"callback.invalid:{port}"]


def test_a_pinned_https_request_sends_the_url_host_as_sni() -> None:
    """The TLS handshake names the URL's host (SNI, and the certificate is checked against
    it) while the socket goes to the pinned address."""
    listener = socket.create_server(("127.0.0.1", 0))
    hello: list[bytes] = []

    def accept() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            hello.append(conn.recv(4096))  # the ClientHello; then hang up

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(OSError):  # no TLS server there: the handshake fails
            request("GET", f"https://callback.invalid:{port}/", timeout_s=5, connect_to="127.0.0.1")
        thread.join(timeout=5)
    finally:
        listener.close()
    assert hello and b"callback.invalid" in hello[0]


def test_pinned_addresses_that_never_answer_share_one_deadline() -> None:
    """Each address dialled had a whole ``timeout_s`` of its own: three that never
    answer held the request three times its deadline, since the watchdog has no socket
    to cut before one connects."""
    # A listener whose backlog is full: the kernel drops further handshakes, so a
    # connect to it waits (as to an address that never answers) until its timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(4):  # fill the queue (no accept: they stay there)
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            queued.append(sock)
        url = f"http://callback.invalid:{port}/"
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            request("GET", url, timeout_s=1.0, connect_to=("127.0.0.1",) * 3)
        assert time.monotonic() - started < 2.0, "each address had the whole deadline"
    finally:
        for sock in queued:
            sock.close()
        listener.close()
