"""0.1's flat setting names, moved into the 0.2 sections with a deprecation warning.

A configuration file or environment written for 0.1 keeps loading: ``lease_ttl_s = 30``
becomes ``[lease] ttl_s = 30`` and ``TORPOR_LEASE_TTL_S`` becomes ``TORPOR_LEASE__TTL_S``,
each with one warning line naming the new key. Serve deployment options that used to be
settings are ignored with a warning pointing at the Serve config.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

log = logging.getLogger("torpor.settings")

# old flat key -> (section, key)
MOVED: dict[str, tuple[str, str]] = {
    "object_store_url": ("storage", "object_store_url"),
    "index_url": ("storage", "index_url"),
    "s3": ("storage", "s3"),
    "redis_prefix": ("storage", "redis_prefix"),
    "index_buckets": ("storage", "index_buckets"),
    "index_deadline_shards": ("storage", "index_deadline_shards"),
    "binding_grace_s": ("storage", "binding_grace_s"),
    "lease_ttl_s": ("lease", "ttl_s"),
    "heartbeat_s": ("lease", "heartbeat_s"),
    "reconcile_interval_s": ("reconciler", "interval_s"),
    "poll_backoff_base_s": ("reconciler", "poll_backoff_base_s"),
    "poll_backoff_cap_s": ("reconciler", "poll_backoff_cap_s"),
    "wake_grace_s": ("reconciler", "wake_grace_s"),
    "full_repair_interval_s": ("reconciler", "full_repair_interval_s"),
    "notify_key": ("notifications", "key"),
    "notify_on": ("notifications", "on"),
    "notify_timeout_s": ("notifications", "timeout_s"),
    "allow_private_callbacks": ("notifications", "allow_private_callbacks"),
    "capability_keys": ("security", "capability_keys"),
    "max_request_bytes": ("security", "max_request_bytes"),
    "pool_size": ("pool", "size"),
    "pool_max_concurrency": ("pool", "max_concurrency"),
}

# Serve deployment options: they live in the Serve config (deploy/serve_config.yaml) now.
SERVE_OPTIONS = {
    "http_host": "http_options.host",
    "http_port": "http_options.port",
    "replicas": "num_replicas",
    "max_ongoing_requests": "max_ongoing_requests",
    "access_log": "logging_config.enable_access_log",
}
DROPPED = {"owner_tag"}  # never read by 0.1 either

# 0.1 read only scalar settings from the environment; these are the ones that moved.
_SCALAR_ENV = [k for k in MOVED if k not in {"s3", "notify_key", "notify_on", "capability_keys"}]

Where = Literal["file", "keyword", "environment"]


def upgrade_flat_keys(data: Mapping[str, Any], *, where: Where) -> dict[str, Any]:
    """``data`` with every 0.1 flat key moved into its section (a section key given in
    the same mapping wins) and the Serve-only keys dropped, each with a warning."""
    out = dict(data)
    for old in [k for k in out if k in MOVED or k in SERVE_OPTIONS or k in DROPPED]:
        value = out.pop(old)
        if old in MOVED:
            section, key = MOVED[old]
            _warn(old, section, key, where)
            current = out.get(section)
            # A section given as a model (keyword use) is taken whole: it is explicit.
            if current is None or isinstance(current, Mapping):
                out[section] = {key: value, **(current or {})}
        elif old in SERVE_OPTIONS:
            _say(
                f"torpor setting {_name(old, where)} is ignored: it is a Serve deployment "
                f"option now; set {SERVE_OPTIONS[old]} in the Serve config"
            )
        else:
            _say(f"torpor setting {_name(old, where)} is ignored: it was never used")
    return out


def legacy_environment(environ: Mapping[str, str], *, s3_keys: Iterable[str]) -> dict[str, Any]:
    """0.1's flat ``TORPOR_*`` variables, as sectioned settings data."""
    flat: dict[str, Any] = {
        k: environ[f"TORPOR_{k.upper()}"]
        for k in [*_SCALAR_ENV, *SERVE_OPTIONS, *DROPPED]
        if f"TORPOR_{k.upper()}" in environ
    }
    s3 = {
        k: environ[f"TORPOR_S3_{k.upper()}"] for k in s3_keys if f"TORPOR_S3_{k.upper()}" in environ
    }
    for key in s3:
        _say(
            f"torpor environment variable TORPOR_S3_{key.upper()} is deprecated; "
            f"use TORPOR_STORAGE__S3__{key.upper()}"
        )
    upgraded = upgrade_flat_keys(flat, where="environment")
    if s3:
        upgraded.setdefault("storage", {})["s3"] = s3
    return upgraded


def _name(old: str, where: Where) -> str:
    return f"TORPOR_{old.upper()}" if where == "environment" else old


def _warn(old: str, section: str, key: str, where: Where) -> None:
    new = (
        f"TORPOR_{section.upper()}__{key.upper()}" if where == "environment" else f"{section}.{key}"
    )
    kind = "environment variable" if where == "environment" else "setting"
    _say(f"torpor {kind} {_name(old, where)} is deprecated; use {new}")


def _say(message: str) -> None:
    # The warning is for programs and tests; the log line is what an operator sees, since
    # Python hides DeprecationWarning outside __main__.
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    log.warning(message)
