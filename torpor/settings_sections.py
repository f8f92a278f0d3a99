"""The deployment's settings sections (``torpor.settings``): storage, lease, reconciler,
notifications, security, session core, batches and the pooled hosts, each validated on
its own; and ``_Section``, the frozen, strict base of every configuration model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from torpor.errors import ConfigError, WebhookSecretInvalid
from torpor.settings_secrets import shown_url
from torpor.storage_urls import scheme_lowered
from torpor.webhooks.capability import check_key


class _Section(BaseModel):
    # No NaN or infinity anywhere: NaN compares false both ways (a deadline never due, a
    # window never closed) and an infinite duration overflows the first timedelta.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


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

    @field_validator("index_url", "object_store_url")
    @classmethod
    def _scheme_in_lower_case(cls, value: str) -> str:
        # The adapters are chosen by the scheme as lower-case text (``storage.factory``).
        return scheme_lowered(value)

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
    # Ray lets an async actor go only once every call it is running has ended: one that
    # never ends (a loop held by a blocking call, a call awaiting what will not come) kept
    # an exiting session actor alive, answering nothing, under its session's name.
    # At least a second: the exit's own last answers (``finished``, ``retire``) go first.
    # At most a minute: a holder asks a left standby to go for as long, and its close
    # (a Serve replica's, within Serve's graceful shutdown) waits for those asks.
    actor_exit_grace_s: float = Field(
        10.0,
        ge=1,
        le=60,
        description="a session actor, standby or work watcher that is exiting ends its "
        "process this long after, if calls still running hold it (1-60)",
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
