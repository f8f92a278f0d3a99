"""Outbound URLs torpor will call (notifications): no private networks unless allowed.

A callback URL is chosen by a client; without this check a tenant could make torpor POST
to the metadata service or an internal admin port. The check runs at submission and
again at delivery on the addresses the name resolves to then (DNS can change).
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from torpor.errors import UnsafeUrl


def check_url_shape(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise UnsafeUrl("callback_url must be an absolute http(s) URL")
    if parts.username or parts.password:
        raise UnsafeUrl("callback_url must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise UnsafeUrl("callback_url has an invalid port") from exc
    return parts.hostname, port


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def check_callback_url(url: str, *, allow_private: bool) -> None:
    """Raise ``UnsafeUrl`` unless every address ``url`` resolves to may be called."""
    host, port = check_url_shape(url)
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise UnsafeUrl(f"callback_url host {host!r} does not resolve") from exc
    for info in infos:
        if not is_public(str(info[4][0])):
            raise UnsafeUrl("callback_url points to a private or reserved address")
