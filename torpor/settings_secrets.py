"""Secrets in settings (``torpor.settings``): the ``env:NAME`` indirection resolved at
use time, and URLs shown without the credentials they may carry."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from pydantic import SecretStr

from torpor.errors import ConfigError


def resolve_secret(value: SecretStr | str, environ: Mapping[str, str] | None = None) -> str:
    """The value itself, or for ``"env:NAME"`` the environment variable NAME, read now.

    The one place the ``env:`` indirection is resolved: settings secrets and plugin
    options both go through it.
    """
    raw = value.get_secret_value() if isinstance(value, SecretStr) else value
    if not raw.startswith("env:"):
        return raw
    name = raw[4:]
    env = os.environ if environ is None else environ
    if name not in env:
        raise ConfigError(f"env:{name} refers to environment variable {name}, which is not set")
    return env[name]


def shown_url(url: str) -> str:
    """``url`` safe to show in an error or a log: without the ``user:password@`` or the
    query (redis-py reads ``?password=``) a URL may carry; ``env:NAME`` as written."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "[unparsable URL]"
    if "@" not in parts.netloc and not parts.query:
        return url
    if "@" in parts.netloc:
        parts = parts._replace(netloc="[redacted]@" + parts.netloc.rpartition("@")[2])
    if parts.query:
        parts = parts._replace(query="[redacted]")
    return parts.geturl()
