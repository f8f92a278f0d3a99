"""Outbound URLs torpor will call (notifications): no private networks unless allowed.

A callback URL is chosen by a client; without this check a tenant could make torpor POST
to the metadata service or an internal admin port. The check runs at submission and
again at delivery on the addresses the name resolves to then (DNS can change). At
delivery, ``vet_callback_url`` returns the addresses it vetted and the request dials those
addresses (``torpor.outbound``'s ``connect_to``): resolving the name a second time to
connect would let a name with a zero TTL answer a public address to the check and
127.0.0.1 to the connection (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from torpor.errors import ResolversBusy, UnsafeUrl
from torpor.threads import ProcessPool

# Name resolutions get threads of their own: a tenant's slow-resolving callback host
# holds one of these, never a thread an LLM step or a delivery needs.
RESOLVERS = ProcessPool(16, "torpor-dns")
# socket.getaddrinfo's shape; tests inject a resolver that changes its answer.
Resolver = Callable[..., Sequence[tuple[Any, ...]]]

# Prefixes that carry an IPv4 address in their low 32 bits: a relay or translator on the
# path turns them into that IPv4 address, private or not.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.ip_network("::/96")
_V4_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")  # SIIT (RFC 2765): ::ffff:0:a.b.c.d
# RFC 8215's local-use NAT64 prefix: a translator of the operator's own network, whose
# IPv4 side may be anything inside it (and sits at a place the prefix length decides).
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


# What http.client refuses in a request target (it raises rather than send it).
_UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")


def check_url_shape(url: str) -> tuple[str, int]:
    # Looked for in the URL as given: urlsplit drops tabs and line feeds unseen. Such a
    # URL (or a non-ASCII path or query) passed here and failed every attempt to send to
    # it, for a day, into a dead letter. A non-ASCII host is fine (IDNA-encoded).
    if _UNSENDABLE.search(url):
        raise UnsafeUrl("callback_url must not contain spaces or control characters")
    try:  # a bracketed host that is no IPv6 address, a netloc that NFKC changes...
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:
        raise UnsafeUrl("callback_url is not a valid URL") from exc
    if parts.scheme not in {"http", "https"} or not host:
        raise UnsafeUrl("callback_url must be an absolute http(s) URL")
    if not (parts.path + parts.query).isascii():
        raise UnsafeUrl("callback_url path and query must be ASCII (percent-encoded)")
    if parts.username or parts.password:
        raise UnsafeUrl("callback_url must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeUrl("callback_url has an invalid port") from exc
    return host, port


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's address
    if ip in _NAT64 or ip in _V4_TRANSLATED or (ip in _V4_COMPATIBLE and int(ip) > 1):
        # (::/96 but not :: or ::1)
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(address: str) -> bool:
    """True if ``address`` (and any IPv4 address embedded in it) is globally routable."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        embedded = _embedded_v4(ip)
        if embedded is not None:  # reached through that IPv4 address: judge it instead
            return embedded.is_global and not embedded.is_multicast
    return ip.is_global and not ip.is_multicast


def vet_callback_url(
    url: str, *, allow_private: bool, resolve: Resolver | None = None
) -> tuple[str, ...] | None:
    """The addresses to connect to for ``url``, each once, in the resolver's order, once
    every address it resolves to may be called (``UnsafeUrl`` otherwise). All of them,
    not the first: a host with an IPv6 address this machine cannot reach, or a dead one
    among several, failed every attempt dialled at that one, where an unpinned connection
    tries the next. None when private addresses are allowed (nothing to pin). A failed
    resolution raises ``OSError`` (``socket.gaierror``) unchanged: it may pass, so the
    caller retries it."""
    host, port = check_url_shape(url)
    if allow_private:
        return None
    try:
        infos = (resolve or socket.getaddrinfo)(host, port, proto=socket.IPPROTO_TCP)
    except UnicodeError as exc:  # IDNA refuses it (an empty or 64-character label...)
        raise UnsafeUrl("callback_url host is not a valid domain name") from exc
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise socket.gaierror(socket.EAI_NONAME, f"{host!r} has no address")
    for address in addresses:
        if not is_public(address):
            raise UnsafeUrl("callback_url points to a private or reserved address")
    return tuple(dict.fromkeys(addresses))  # one socket type may list an address twice


async def vetted_address(
    url: str,
    *,
    allow_private: bool,
    timeout_s: float,
    resolve: Resolver | None = None,
    ends: float | None = None,
) -> tuple[str, ...] | None:
    """``vet_callback_url`` in a resolver thread, the resolution within ``timeout_s``: a
    resolver that does not answer is a failed resolution (``OSError``, so retried), not
    a wait without end outside the attempt's deadline. The deadline starts when a thread
    takes the call (waiting for one is not the resolver's slowness), and the wait for a
    thread is bounded by it too (``ResolversBusy``). ``ends`` (a ``time.monotonic()``, a
    delivery attempt's deadline) bounds the whole call, the wait included. A thread that
    times out is left to its resolver."""
    wait_s = timeout_s if ends is None else max(0.0, min(timeout_s, ends - time.monotonic()))
    loop = asyncio.get_running_loop()
    taken = asyncio.Event()

    def resolve_now() -> tuple[str, ...] | None:
        loop.call_soon_threadsafe(taken.set)
        return vet_callback_url(url, allow_private=allow_private, resolve=resolve)

    call = asyncio.ensure_future(RESOLVERS.run(resolve_now))
    waiting = asyncio.ensure_future(taken.wait())
    try:
        await asyncio.wait({call, waiting}, timeout=wait_s, return_when=FIRST_COMPLETED)
    except BaseException:  # cancelled (a delivery attempt's deadline): never started now
        if not taken.is_set():
            call.cancel()
        raise
    finally:
        waiting.cancel()
    if not taken.is_set() and not call.done():
        call.cancel()  # not started: it never will be
        raise ResolversBusy(f"no resolver thread was free within {wait_s:g} s")
    resolve_s = timeout_s if ends is None else max(0.0, ends - time.monotonic())
    try:
        return await asyncio.wait_for(call, resolve_s)
    except TimeoutError:
        raise socket.gaierror(socket.EAI_AGAIN, f"no DNS answer within {timeout_s:g} s") from None


async def check_callback(
    url: str, *, allow_private: bool, timeout_s: float, resolve: Resolver | None = None
) -> None:
    """Raise ``UnsafeUrl`` unless every address ``url`` resolves to may be called (the
    check at submission), the resolution within ``timeout_s``."""
    host, _ = check_url_shape(url)
    try:
        await vetted_address(url, allow_private=allow_private, timeout_s=timeout_s, resolve=resolve)
    except ResolversBusy:
        raise  # not the URL's fault: 503, try again
    except OSError as exc:
        raise UnsafeUrl(f"callback_url host {host!r} does not resolve") from exc
