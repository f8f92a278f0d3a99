"""Storage URLs read one way everywhere: by the settings (``Settings.embedded``, which
the refusal of embedded storage on a cluster reads) and by the factory that opens the
adapters (``storage.factory``)."""

from __future__ import annotations

import re

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def scheme_lowered(url: str) -> str:
    """``url`` with its scheme in lower case and the rest as written (a path, a password).
    Schemes are case-insensitive (RFC 3986, 3.1), and redis-py reads ``REDIS://`` as
    ``redis://``; every check and adapter here matches the scheme as lower-case text, so
    ``REDIS://`` was refused as an unknown scheme and ``FILE://`` taken for a bare path.
    ``file:`` without ``//`` too (RFC 8089); ``env:NAME`` is left as written."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, sep, rest = url.partition(":")
        if head.lower() != "file":
            return url
    if not _SCHEME.fullmatch(head) or head.islower():
        return url
    return f"{head.lower()}{sep}{rest}"


def local_folder(url: str) -> str | None:
    """The folder an object store URL names on this host: a ``file:`` URL's path
    (``file:///abs``, ``file://localhost/abs``, ``file:/abs``, ``file://relative``,
    ``file:relative``) or a bare path (no scheme); None for any other scheme. The one
    reading of it: the settings counted ``file:`` URLs as embedded storage and the
    factory opened bare paths too, so a bare path beside a Redis index passed the refusal
    on a cluster of several nodes, and ``file:/abs`` was opened as a folder named
    ``file:`` under the working one."""
    if url.startswith("file:"):
        rest = url[len("file:") :]
        if not rest.startswith("//"):
            return rest
        rest = rest[2:]
        # ``localhost`` is this host (RFC 8089, 2): ``file://localhost/abs`` is ``/abs``,
        # not a folder named ``localhost`` under the working one; ``file://localhost``
        # alone names no path, as ``file://`` does. Any other first part stays this
        # project's relative form (``file://relative``).
        host, slash, path = rest.partition("/")
        if host.lower() != "localhost":
            return rest
        return slash + path  # ``file://localhost`` alone names no path: ""
    head, colon, _ = url.partition(":")
    if "://" in url or (colon and len(head) > 1 and _SCHEME.fullmatch(head)):
        return None  # another scheme (``memory:``, ``env:NAME``, ``s3:bucket``): not a path
    return url
