"""Typed settings, read once, secrets hidden.

Settings come from an optional TOML file (``TORPOR_CONFIG``) with environment variables
on top (``TORPOR_OBJECT_STORE_URL`` …). Secrets are ``SecretStr``: they never print. A
secret in the file may be written ``"env:NAME"`` to take it from the environment, so
configuration files can be committed without the secrets themselves.

With nothing configured, torpor runs on embedded defaults: a local folder for objects and
SQLite for the index, under ``.torpor/`` in the working directory.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from torpor.errors import ConfigError
from torpor.webhooks.payloads import PayloadMapping
from torpor.webhooks.signing import Scheme


class Placement(StrEnum):
    DEDICATED = "dedicated"  # one named actor per live session, exits when the session sleeps
    POOLED = "pooled"  # a few long-lived hosts run activations routed by session id


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AgentConfig(_Settings):
    """An agent as configuration names it: where to import it and its tools from."""

    factory: str  # "package.module:callable" returning an Agent
    options: dict[str, Any] = Field(default_factory=dict)
    tools: list[str] = Field(default_factory=list)  # "package.module:callable" → tool(s)
    tool_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    placement: Placement = Placement.DEDICATED
    max_tool_retries: int = 3


class SourceConfig(_Settings):
    """A webhook sender: whose tenant it speaks for, and how it proves who it is."""

    tenant: str
    scheme: Scheme = Scheme.TORPOR
    # Every active secret; several during a rotation (the sender signs with either).
    secrets: list[SecretStr] = Field(min_length=1)
    tolerance_s: float = 300.0
    max_body_bytes: int = 256 * 1024
    # Non-CloudEvents JSON: where correlation id, business key, status, id and type are.
    mapping: PayloadMapping | None = None
    # CloudEvents webhook abuse-protection handshake (OPTIONS): origins that may send.
    allowed_origins: list[str] = Field(default_factory=list)
    allowed_rate: int | None = None

    def secret_values(self) -> list[str]:
        return [resolve_secret(s) for s in self.secrets]


class TenantConfig(_Settings):
    # Bearer API keys, stored hashed ("sha256:<hex>"); see ``torpor keys``.
    api_keys: list[str] = Field(default_factory=list)


class S3Settings(_Settings):
    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None


def resolve_secret(value: SecretStr, environ: Mapping[str, str] | None = None) -> str:
    """The secret's value; ``env:NAME`` reads it from the environment at use time."""
    raw = value.get_secret_value()
    if raw.startswith("env:"):
        name = raw[4:]
        env = os.environ if environ is None else environ
        if name not in env:
            raise ConfigError(f"secret refers to environment variable {name}, which is not set")
        return env[name]
    return raw


class Settings(_Settings):
    object_store_url: str = "file://.torpor/objects"
    index_url: str = "sqlite://.torpor/index.db"
    s3: S3Settings = Field(default_factory=S3Settings)
    redis_prefix: str = "tp:"
    namespace: str = "torpor"
    agents: dict[str, AgentConfig] = Field(default_factory=dict)

    # single writer
    lease_ttl_s: float = 45.0  # 3 missed heartbeats
    heartbeat_s: float = 15.0
    # index entries outlive their deadline by this much, so a late callback still resolves
    binding_grace_s: float = 7 * 24 * 3600
    # deadlines: a tool call (unless the tool sets its own), one agent step, one activation
    tool_timeout_s: float = 60.0
    agent_step_timeout_s: float = 300.0
    activation_max_s: float = 15 * 60.0
    # the session core's retries: capped exponential backoff with jitter
    retry_backoff_base_s: float = 2.0
    retry_backoff_cap_s: float = 600.0
    # reconciler
    reconcile_interval_s: float = 5.0
    poll_backoff_base_s: float = 60.0
    poll_backoff_cap_s: float = 6 * 3600.0
    wake_grace_s: float = 30.0  # inbox event with no confirmed activation after this → wake
    full_repair_interval_s: float = 3600.0
    # Where webhook senders reach this deployment, for capability callback URLs.
    public_url: str = "http://127.0.0.1:8000"
    # Keys that sign capability callback tokens; the first signs, all verify (rotation).
    capability_keys: list[SecretStr] = Field(default_factory=list)
    # webhook senders and API tenants
    sources: dict[str, SourceConfig] = Field(default_factory=dict)
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    max_request_bytes: int = 1024 * 1024
    # Activation requests a replica keeps in flight; past this, woken sessions wait for
    # the reconciler's sweep (their events are durable and their wake-up timers set).
    max_inflight_activations: int = 256
    # outbound notifications: per-endpoint secrets are derived from this key
    notify_key: SecretStr | None = None
    notify_on: list[str] = Field(default_factory=lambda: ["terminal"])
    notify_timeout_s: float = 15.0
    allow_private_callbacks: bool = False  # refuse private/loopback targets (SSRF) unless set
    # Ray Serve
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    replicas: int = 1
    max_ongoing_requests: int = 200
    access_log: bool = False  # Serve's per-request access log (off: webhooks are high volume)
    index_buckets: int = 512
    index_deadline_shards: int = 128
    pool_size: int = 2
    pool_max_concurrency: int = 64
    # Dedicated session actors alive at once, per activator; past it, activation requests
    # wait for their WAKE/RETRY timer (durable) instead of starting another process.
    max_live_session_actors: int = 256
    owner_tag: str = ""  # appended to lease owners, for debugging several clusters

    @field_validator("lease_ttl_s")
    @classmethod
    def _ttl_covers_heartbeats(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("lease_ttl_s must be positive")
        return value

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, config_path: str | Path | None = None
    ) -> Settings:
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        path = config_path or env.get("TORPOR_CONFIG")
        if path:
            data = load_toml(Path(path))
        for name, field in cls.model_fields.items():
            value = env.get(f"TORPOR_{name.upper()}")
            if value is None:
                continue
            if field.annotation in (str, float, int):
                data[name] = value
            elif field.annotation is bool:
                data[name] = value.strip().lower() in {"1", "true", "yes", "on"}
        s3 = dict(data.get("s3", {}))
        for name in S3Settings.model_fields:
            value = env.get(f"TORPOR_S3_{name.upper()}")
            if value is not None:
                s3[name] = value
        if s3:
            data["s3"] = s3
        return cls.build(data)

    @classmethod
    def build(cls, data: Mapping[str, Any]) -> Settings:
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"invalid setting {where}: {first['msg']}") from exc

    def capability_key_bytes(self) -> list[bytes]:
        return [resolve_secret(k).encode() for k in self.capability_keys]

    @property
    def embedded(self) -> bool:
        return self.object_store_url.startswith("file:") or self.index_url.startswith("sqlite:")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
