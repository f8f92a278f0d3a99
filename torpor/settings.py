"""Typed settings, read once, secrets hidden.

Settings come from an optional TOML file (``TORPOR_CONFIG`` or an explicit path) with
environment variables on top: ``TORPOR_`` prefix, ``__`` between a section and its key
(``TORPOR_LEASE__TTL_S=30`` sets ``[lease] ttl_s``). Secrets are ``SecretStr``: they
never print. A secret may be written ``"env:NAME"`` to take it from the environment at
use time (:func:`resolve_secret`), so configuration files can be committed without them.

With nothing configured, torpor runs on embedded defaults: a local folder for objects and
SQLite for the index, under ``.torpor/`` in the working directory.

Files and variables written for 0.1 (flat keys such as ``lease_ttl_s`` or
``TORPOR_LEASE_TTL_S``) still load: :mod:`torpor.settings_compat` moves them into their
section with a one-line deprecation warning naming the new key. Serve deployment options
(replicas, HTTP host and port, access log) belong to the Serve config, not here.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from torpor.errors import ConfigError, WebhookSecretInvalid
from torpor.ids import is_safe_identifier
from torpor.models import FanInSpec
from torpor.settings_compat import legacy_environment, upgrade_flat_keys
from torpor.webhooks.capability import check_key
from torpor.webhooks.payloads import PayloadMapping
from torpor.webhooks.signing import Scheme, decode_key, signed_shape

ENV_PREFIX = "TORPOR_"
ENV_NESTING = "__"
# Sources torpor's own inbox events carry (cancel, retry, dispatch failures; capability
# callbacks): a configured webhook source may not take these names.
RESERVED_SOURCE_NAMES = frozenset({"torpor", "capability"})


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


class Placement(StrEnum):
    DEDICATED = "dedicated"  # one named actor per live session, exits when the session sleeps
    POOLED = "pooled"  # a few long-lived hosts run activations routed by session id


class _Section(BaseModel):
    # No NaN or infinity anywhere: NaN compares false both ways (a deadline never due, a
    # window never closed) and an infinite duration overflows the first timedelta.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class AgentConfig(_Section):
    """An agent as configuration names it: where to import it and its tools from."""

    factory: str = Field(description='`"package.module:callable"` returning the Agent')
    options: dict[str, Any] = Field(
        default_factory=dict, description='keyword arguments for the factory (`"env:NAME"` ok)'
    )
    tools: list[str] = Field(
        default_factory=list, description='`"package.module:callable"` returning tool(s)'
    )
    tool_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="keyword arguments per entry of `tools`"
    )
    placement: Placement = Field(
        Placement.DEDICATED, description="`dedicated` (one actor per session) or `pooled`"
    )
    max_tool_retries: int = Field(3, ge=0, description="attempts of a failing sync tool call")
    max_steps: int = Field(
        1000,
        ge=1,
        description="agent steps one session may take in all; past them it fails "
        "(`step_limit`): a model that never stops calling tools does not run for ever",
    )
    answer_sources: dict[str, list[str]] = Field(
        default_factory=dict,
        description="webhook sources that may answer each long-running tool's waits, by tool",
    )
    fan_in: FanInSpec = Field(
        default_factory=FanInSpec,
        description="several long-running calls in one turn: one fan-in group with this "
        "condition (`all`, `any`, `n_of_m` with `n`) and expiry policy",
    )


class SourceConfig(_Section):
    """A webhook sender: whose tenant it speaks for, and how it proves who it is."""

    tenant: str = Field(description="the tenant this sender speaks for")
    scheme: Scheme = Field(
        Scheme.TORPOR, description="signature scheme: `torpor`, `standard`, `github`, `stripe`"
    )
    secrets: list[SecretStr] = Field(
        min_length=1, description="every active secret; several during a rotation"
    )
    # Finite and positive: NaN compares false both ways and turned the window off; a day
    # at most, as the replay claims and lookup windows are sized from it.
    tolerance_s: float = Field(
        300.0,
        gt=0,
        le=24 * 3600,
        allow_inf_nan=False,
        description="accepted clock skew of the timestamp, both ways",
    )
    # Positive: 0 or less refused every delivery (413) while the source looked configured.
    max_body_bytes: int = Field(
        256 * 1024, gt=0, description="larger webhook bodies are refused (413); at least 1"
    )
    mapping: PayloadMapping | None = Field(
        None, description="for non-CloudEvents JSON: where id, type, correlation id, … are"
    )
    allowed_origins: list[str] = Field(
        default_factory=list, description="origins allowed by the CloudEvents OPTIONS handshake"
    )
    allowed_rate: int | None = Field(
        None, ge=1, description="`WebHook-Allowed-Rate` in the handshake (`*` if unset)"
    )
    receives_result: bool = Field(
        False, description="late and duplicate answers carry the session's result, not only state"
    )

    @field_validator("secrets")
    @classmethod
    def _secrets_make_keys(cls, value: list[SecretStr], info: ValidationInfo) -> list[SecretStr]:
        # A secret no delivery could verify with (empty, or not base64 for `standard`)
        # failed every request with a 500. An `env:` one is checked where it is resolved
        # (secret_values): the process that loads the settings may not have the variable.
        scheme = info.data.get("scheme")
        if scheme is None:
            return value  # the scheme itself was refused; that is the error reported
        for index, secret in enumerate(value):
            raw = secret.get_secret_value()
            if not raw.startswith("env:"):
                try:
                    decode_key(scheme, raw, index)
                except WebhookSecretInvalid as exc:
                    raise ValueError(str(exc)) from None
        return value

    def secret_values(self, source: str) -> list[str]:
        """The secrets, resolved now; ``WebhookSecretInvalid`` naming ``source`` (never a
        value) if one is unset or unusable, so the delivery is refused as misconfigured."""
        values = []
        for index, secret in enumerate(self.secrets):
            try:
                value = resolve_secret(secret)
                decode_key(self.scheme, value, index)
            except ConfigError as exc:
                raise WebhookSecretInvalid(f"source {source!r}: {exc}") from None
            values.append(value)
        return values


def verifying_secrets(sources: Mapping[str, SourceConfig], name: str) -> list[str]:
    """The secrets source ``name`` verifies with, resolved now (``secret_values``), and
    checked against the other sources whose schemes sign the same bytes: two that share
    a key accept each other's deliveries. Settings refuse that at load for the secrets
    written inline; an ``env:`` one is only known here, where it resolves. Refused as
    misconfigured (``WebhookSecretInvalid``, naming the sources, never a value)."""
    source = sources[name]
    values = source.secret_values(name)
    shape = signed_shape(source.scheme)
    others = [
        (other, config)
        for other, config in sources.items()
        if other != name and signed_shape(config.scheme) == shape
    ]
    if not any(_from_env(config) for _, config in [(name, source), *others]):
        return values  # all inline: compared when the settings loaded
    mine = {decode_key(source.scheme, value) for value in values}
    for other, config in others:
        for secret in config.secrets:
            try:
                key = decode_key(config.scheme, resolve_secret(secret))
            except (ConfigError, WebhookSecretInvalid):
                continue  # unusable there: refused when that source is used
            if key in mine:
                first, second = sorted((other, name))
                raise WebhookSecretInvalid(
                    f"sources {first!r} and {second!r} share a secret and sign the same bytes "
                    f"({shape}): a delivery to one would be accepted by the other"
                )
    return values


def _from_env(source: SourceConfig) -> bool:
    return any(secret.get_secret_value().startswith("env:") for secret in source.secrets)


class TenantConfig(_Section):
    api_keys: list[str] = Field(
        default_factory=list, description="bearer API keys as `sha256:` hashes (`torpor keys api`)"
    )


class S3Settings(_Section):
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO)")
    region: str | None = Field(None, description="S3 region")
    access_key_id: str | None = Field(None, description="S3 access key id")
    secret_access_key: SecretStr | None = Field(None, description="S3 secret key")


class StorageSettings(_Section):
    """Where sessions live (object store) and the rebuildable index beside them."""

    object_store_url: str = Field(
        "file://.torpor/objects", description="`s3://bucket/prefix` for clusters"
    )
    index_url: str = Field(
        "sqlite://.torpor/index.db",
        description="`redis://host:6379/0` for clusters; `env:NAME` when it holds a password",
    )
    s3: S3Settings = Field(default_factory=S3Settings, description="S3 client options")
    redis_prefix: str = Field("tp:", description="Redis key prefix (a `{tag}` on Redis Cluster)")
    index_buckets: int = Field(
        512, ge=1, description="hash buckets of the wait index; raise past ~60k"
    )
    index_deadline_shards: int = Field(128, ge=1, description="shards of the SLA deadline set")
    # A century at most: a deadline (up to a century away) plus the grace must stay a
    # date, or every bind failed with OverflowError instead of the settings at load.
    binding_grace_s: float = Field(
        7 * 24 * 3600,
        ge=0,
        le=100 * 365 * 24 * 3600,
        description="index entries outlive their deadline by this much",
    )
    # A century at most: the sweep takes the period from its clock (``now - keep``), and
    # a period reaching back past year 1 raised OverflowError at every sweep, so nothing
    # was ever deleted again, while the settings loaded without a word.
    retention_s: float = Field(
        30 * 24 * 3600,
        le=100 * 365 * 24 * 3600,
        description="ended sessions and all their records are deleted this long after they end",
    )
    # Bounded: a sweep is one step of the reconciler's loop, which also fires the
    # deadlines; a huge page made one pass list and purge every ended session at once.
    retention_per_sweep: int = Field(
        100, ge=1, le=10_000, description="sessions one sweep deletes at most (1-10,000)"
    )

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # The URLs stay plain strings (every adapter and check reads them as such), but
        # one written with its password inline showed it whole in repr() and str() of the
        # settings, and so in any log line or traceback that held them.
        for name, value in super().__repr_args__():
            if name in ("index_url", "object_store_url") and isinstance(value, str):
                value = shown_url(value)
            yield name, value

    @field_validator("retention_s")
    @classmethod
    def _retention_outlives_the_windows(cls, value: float) -> float:
        # The idempotency and replay windows (24 h) look records up: they must outlive them.
        if value < 24 * 3600:
            raise ValueError("retention_s must be at least 86400 (the 24 h windows)")
        return value


class LeaseSettings(_Section):
    """The single-writer lease a running activation holds."""

    ttl_s: float = Field(45.0, description="lease lifetime (three missed heartbeats)")
    heartbeat_s: float = Field(15.0, gt=0, description="lease renewal period")

    @field_validator("ttl_s")
    @classmethod
    def _ttl_is_positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("ttl_s must be positive")
        return value

    @model_validator(mode="after")
    def _heartbeat_renews_in_time(self) -> LeaseSettings:
        # Renewed no sooner than it expires, a lease lapsed between two heartbeats: every
        # activation longer than the TTL lost it to the reconciler's recovery, again and
        # again (LEASE_LOST), while it still ran.
        if self.heartbeat_s >= self.ttl_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s:g}) must be shorter than ttl_s "
                f"({self.ttl_s:g}): a lease would lapse between its renewals"
            )
        return self


class ReconcilerSettings(_Section):
    """The detached sweeper: timeouts, polls, lost leases, repairs."""

    # Positive: at 0 or less a loop that sleeps for it spins, and a backoff never grows.
    interval_s: float = Field(5.0, gt=0, description="sweep period")
    poll_backoff_base_s: float = Field(60.0, gt=0, description="first poll of an overdue wait")
    poll_backoff_cap_s: float = Field(6 * 3600.0, gt=0, description="longest gap between polls")
    wake_grace_s: float = Field(
        30.0, gt=0, description="an event with no activation after this wakes"
    )
    full_repair_interval_s: float = Field(
        3600.0, gt=0, description="index rebuild from object storage"
    )
    deadline_interval_s: float = Field(
        0.25, gt=0, description="due SLA deadlines are also looked up this often between sweeps"
    )

    @model_validator(mode="after")
    def _cap_is_not_below_base(self) -> ReconcilerSettings:
        _ordered(self.poll_backoff_base_s, self.poll_backoff_cap_s, "poll_backoff")
        return self


class NotificationSettings(_Section):
    """Signed outbound webhooks to submitters."""

    key: SecretStr | None = Field(None, description="per-endpoint secrets are derived from it")
    on: list[str] = Field(
        default_factory=lambda: ["terminal"], description="`terminal`, `suspended`, `resumed`"
    )
    # Positive: at 0 every attempt timed out, and every delivery ended a dead letter.
    timeout_s: float = Field(15.0, gt=0, description="deadline of one delivery attempt")
    allow_private_callbacks: bool = Field(
        False, description="permit private/loopback callback URLs (SSRF guard off)"
    )


# As for capability keys: a console cookie's HMAC key an attacker cannot guess offline.
CONSOLE_KEY_MIN_BYTES = 16


def _check_console_key(key: bytes) -> None:
    if len(key) < CONSOLE_KEY_MIN_BYTES:
        raise ConfigError(f"security.console_key must be at least {CONSOLE_KEY_MIN_BYTES} bytes")


class SecuritySettings(_Section):
    """Keys and limits at the HTTP edge."""

    capability_keys: list[SecretStr] = Field(
        default_factory=list,
        description="sign capability links; the first signs, all verify; 16 bytes at least",
    )
    max_request_bytes: int = Field(1024 * 1024, gt=0, description="larger API bodies are refused")

    audit_key: SecretStr | None = Field(
        None,
        description="signs the audit log's checkpoints (HMAC-SHA256); without it they are unsigned",
    )
    max_streams_per_tenant: int = Field(
        16,
        ge=0,
        description="event streams (SSE) one tenant may hold open on one replica; then 429",
    )
    inline_secrets_in_ray: bool = Field(
        False,
        description="let inline secrets into Ray actor arguments (tests, demos: Ray stores them)",
    )
    benchmark_noop: bool = Field(
        False,
        description="serve the unauthenticated `POST /v1/noop` benchmark baseline (404 when off)",
    )
    operator_keys: list[str] = Field(
        default_factory=list,
        description="hashes (`sha256:…`) of operator keys: console, operator routes, all tenants",
    )
    console_key: SecretStr | None = Field(
        None,
        description=(
            "signs console login cookies; 16 bytes at least; unset: a random key per replica"
            " (re-login)"
        ),
    )

    @field_validator("console_key")
    @classmethod
    def _console_key_is_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        # Every console user holds a cookie signed with it, payload and MAC: a short key
        # was found offline from a tenant's own login, and then signed an operator's. An
        # `env:` one is checked where it resolves (Settings.console_key_bytes).
        raw = value.get_secret_value() if value is not None else ""
        if raw and not raw.startswith("env:"):
            try:
                _check_console_key(raw.encode())
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("capability_keys")
    @classmethod
    def _capability_keys_are_long_enough(cls, value: list[SecretStr]) -> list[SecretStr]:
        # A short key was accepted, and every session that suspended then failed to mint
        # its callback link. An `env:` one is checked where it resolves
        # (Settings.capability_key_bytes, when a process opens its services).
        for index, key in enumerate(value):
            raw = key.get_secret_value()
            if not raw.startswith("env:"):
                try:
                    check_key(raw.encode(), index)
                except WebhookSecretInvalid as exc:
                    raise ValueError(str(exc)) from None
        return value


class RuntimeSettings(_Section):
    """Deadlines and retries of the session core."""

    tool_timeout_s: float = Field(
        60.0, gt=0, description="deadline of a tool call (a tool's `timeout_s` wins)"
    )
    agent_step_timeout_s: float = Field(300.0, gt=0, description="deadline of one agent step")
    activation_max_s: float = Field(
        900.0,
        gt=0,
        description="wall-time cap of one activation; past it the session is retried later",
    )
    retry_backoff_base_s: float = Field(
        2.0, gt=0, description="first retry delay of the session core"
    )
    retry_backoff_cap_s: float = Field(
        600.0,
        gt=0,
        description="longest retry delay; `max_tool_retries` per agent, then QUARANTINED",
    )
    max_live_session_actors: int = Field(
        256,
        ge=1,
        description="dedicated session actors one activator keeps alive; more wait as timers",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint, e.g. `http://collector:4318/v1/traces` "
        "(needs `torpor[otlp]`); unset: no spans are exported",
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="torpor's log lines: `text`, or `json` (one object a line with session, "
        "correlation and trace ids)",
    )
    standby_session_actors: int = Field(
        0,
        ge=0,
        description="pre-started dedicated session actors one activator keeps ready to adopt "
        "a session (0: start one per activation)",
    )
    standby_idle_s: float = Field(
        600.0,
        ge=0,
        description="a standby session actor exits this long after its activator last "
        "kept it (every quarter of it while the activator lives), unless it was adopted; "
        "0: never",
    )

    @model_validator(mode="after")
    def _cap_is_not_below_base(self) -> RuntimeSettings:
        _ordered(self.retry_backoff_base_s, self.retry_backoff_cap_s, "retry_backoff")
        return self


def _ordered(base: float, cap: float, name: str) -> None:
    # A cap below the base contradicts it: every delay was the cap, shorter than the first.
    if cap < base:
        raise ValueError(f"{name}_cap_s ({cap:g}) must not be below {name}_base_s ({base:g})")


class BatchSettings(_Section):
    """Batches: the fan-out behind the 202 and the caps on sessions running at once."""

    max_running_per_batch: int = Field(
        64, ge=1, description="RUNNING sessions of one batch at once; the rest wait as PENDING"
    )
    max_running_per_tenant: int = Field(
        256, ge=1, description="RUNNING sessions of all of a tenant's batches at once"
    )
    admission_retry_s: float = Field(
        30.0, gt=0, description="a queued batch session is retried after this at the latest"
    )
    fanout_chunk: int = Field(
        200, ge=1, le=10_000, description="sessions a fan-out creates between cursor saves"
    )


class PoolSettings(_Section):
    """The `pooled` placement's long-lived host actors."""

    size: int = Field(2, ge=1, description="pooled host actors")
    max_concurrency: int = Field(64, ge=1, description="activations one host runs at once")


@dataclass(frozen=True)
class _Inputs:
    environ: Mapping[str, str]
    toml: Path | None


# Which environment and file the next Settings() reads; set by from_env/build, so the
# source hooks (class methods, no arguments) see the caller's choice.
_INPUTS: ContextVar[_Inputs | None] = ContextVar("torpor_settings_inputs", default=None)


class Settings(BaseSettings):
    """Everything torpor reads from configuration; build with :meth:`from_env`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTING, extra="forbid", frozen=True
    )

    namespace: str = Field("torpor", description="Ray namespace of torpor's named actors")
    public_url: str = Field(
        "http://127.0.0.1:8000", description="where webhook senders reach this deployment"
    )
    max_inflight_activations: int = Field(
        256, ge=0, description="per ingress replica; beyond it the reconciler activates"
    )
    agents: dict[str, AgentConfig] = Field(default_factory=dict, description="agents by name")
    sources: dict[str, SourceConfig] = Field(
        default_factory=dict, description="webhook senders by name ([A-Za-z0-9_-.], 1-128)"
    )
    tenants: dict[str, TenantConfig] = Field(default_factory=dict, description="API tenants")
    storage: StorageSettings = Field(default_factory=StorageSettings, description="storage")
    lease: LeaseSettings = Field(default_factory=LeaseSettings, description="single writer")
    reconciler: ReconcilerSettings = Field(
        default_factory=ReconcilerSettings, description="reconciler"
    )
    notifications: NotificationSettings = Field(
        default_factory=NotificationSettings, description="outbound notifications"
    )
    security: SecuritySettings = Field(default_factory=SecuritySettings, description="security")
    pool: PoolSettings = Field(default_factory=PoolSettings, description="pooled placement")
    runtime: RuntimeSettings = Field(
        default_factory=RuntimeSettings, description="session core deadlines and retries"
    )
    batches: BatchSettings = Field(default_factory=BatchSettings, description="batches")

    @field_validator("sources")
    @classmethod
    def _no_reserved_source_names(cls, value: dict[str, SourceConfig]) -> dict[str, SourceConfig]:
        # Inbox event keys are source + event id: a source named like torpor's own events
        # (cancel, dispatch failures) or capability callbacks would share their slots.
        taken = sorted(set(value) & RESERVED_SOURCE_NAMES)
        if taken:
            raise ValueError(f"source name {taken[0]!r} is reserved for torpor's own events")
        # A source's name is part of its replay markers' object keys: one outside their
        # alphabet was accepted here and failed every delivery once its signature passed.
        for name in value:
            if not is_safe_identifier(name):
                raise ValueError(
                    f"source name {name[:80]!r} is not 1-128 of [A-Za-z0-9_-.] "
                    "(nor '.' or '..'): it names objects in storage"
                )
        return value

    @field_validator("tenants")
    @classmethod
    def _no_api_key_for_two_tenants(cls, value: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        # A request is the tenant its key is found under: a key listed under two was taken
        # for the last one, and its holder read and changed that tenant's sessions. The
        # error names the tenants, never the hash.
        holder: dict[str, str] = {}
        for name, tenant in value.items():
            # Its name is part of its object keys (submit keys, deliveries): one outside
            # their alphabet was accepted, and then every keyed submit of it was refused.
            if not is_safe_identifier(name):
                raise ValueError(
                    f"tenant name {name[:80]!r} is not 1-128 of [A-Za-z0-9_-.] "
                    "(nor '.' or '..'): it names objects in storage"
                )
            for hashed in tenant.api_keys:
                other = holder.setdefault(hashed, name)
                if other != name:
                    raise ValueError(
                        f"tenants {other!r} and {name!r} share an API key: each key must "
                        "belong to one tenant"
                    )
        return value

    @field_validator("sources")
    @classmethod
    def _no_key_signs_for_two_sources(
        cls, value: dict[str, SourceConfig]
    ) -> dict[str, SourceConfig]:
        # Replay claims are per source: with one key and schemes that sign the same bytes
        # (the same scheme, or torpor and Stripe), a delivery accepted by one source is
        # accepted again by the other, into its tenant. Keys are compared as the verifier
        # uses them (a `standard` secret decoded); an `env:` one by the variable it names,
        # its value being unknown here. The error names the sources, never the secret.
        holder: dict[tuple[str, bytes], str] = {}
        for name, source in value.items():
            shape = signed_shape(source.scheme)
            for secret in source.secrets:
                raw = secret.get_secret_value()
                key = raw.encode() if raw.startswith("env:") else decode_key(source.scheme, raw)
                other = holder.setdefault((shape, key), name)
                if other != name:
                    raise ValueError(
                        f"sources {other!r} and {name!r} share a secret and sign the same "
                        f"bytes ({shape}): a delivery to one would be accepted by the other; "
                        "give each its own secret"
                    )
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        inputs = _INPUTS.get() or _Inputs(os.environ, _config_path(None, os.environ))
        sources: list[PydanticBaseSettingsSource] = [
            _FlatKeys(settings_cls, init_settings),
            _Environment(settings_cls, inputs.environ),
            _LegacyEnvironment(settings_cls, inputs.environ),
        ]
        if inputs.toml is not None:
            sources.append(_TomlFile(settings_cls, inputs.toml))
        return tuple(sources)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, config_path: str | Path | None = None
    ) -> Settings:
        """Settings from the TOML file (``config_path`` or ``TORPOR_CONFIG``) and ``environ``."""
        env = os.environ if environ is None else environ
        with _reading(_Inputs(env, _config_path(config_path, env))):
            return cls._validated({})

    @classmethod
    def build(cls, data: Mapping[str, Any]) -> Settings:
        """Settings from ``data`` alone (no environment, no file): for tests and tools."""
        with _reading(_Inputs({}, None)):
            return cls._validated(data)

    @classmethod
    def _validated(cls, data: Mapping[str, Any]) -> Settings:
        try:
            return cls(**dict(data))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"invalid setting {where}: {first['msg']}") from exc
        except SettingsError as exc:
            raise ConfigError(f"invalid setting: {exc}") from exc

    def capability_key_bytes(self) -> list[bytes]:
        """The capability keys, resolved now; ``WebhookSecretInvalid`` (never a value) if
        one is too short."""
        keys = [resolve_secret(k).encode() for k in self.security.capability_keys]
        for index, key in enumerate(keys):
            check_key(key, index)
        return keys

    def console_key_bytes(self) -> bytes | None:
        """The console's cookie key, resolved now; None when unset; ``ConfigError`` (never
        the value) if it is too short."""
        configured = self.security.console_key
        if not configured:
            return None
        key = resolve_secret(configured).encode()
        _check_console_key(key)
        return key

    @property
    def embedded(self) -> bool:
        return self.storage.object_store_url.startswith(
            "file:"
        ) or self.storage.index_url.startswith("sqlite:")


@contextmanager
def _reading(inputs: _Inputs) -> Iterator[None]:
    token = _INPUTS.set(inputs)
    try:
        yield
    finally:
        _INPUTS.reset(token)


def _config_path(explicit: str | Path | None, environ: Mapping[str, str]) -> Path | None:
    path = explicit or environ.get("TORPOR_CONFIG")
    return Path(path) if path else None


class _FlatKeys(PydanticBaseSettingsSource):
    """Keyword arguments, with 0.1's flat keys moved into their sections."""

    def __init__(self, settings_cls: type[BaseSettings], init: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self._init = init

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ answers for every field at once

    def __call__(self) -> dict[str, Any]:
        return upgrade_flat_keys(self._init(), where="keyword")


class _Environment(EnvSettingsSource):
    """``TORPOR_*`` variables from a given mapping (``os.environ`` unless told otherwise)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


class _LegacyEnvironment(PydanticBaseSettingsSource):
    """0.1's flat variables (``TORPOR_LEASE_TTL_S``), below the sectioned ones."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = environ

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return legacy_environment(self._environ, s3_keys=list(S3Settings.model_fields))


class _TomlFile(TomlConfigSettingsSource):
    """The TOML file, which must exist; 0.1's flat keys move into their sections."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path) -> None:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        super().__init__(settings_cls, toml_file=path)

    def _read_file(self, file_path: Any) -> dict[str, Any]:
        return upgrade_flat_keys(load_toml(Path(file_path)), where="file")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
