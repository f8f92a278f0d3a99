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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from torpor.errors import ConfigError
from torpor.ids import not_a_name
from torpor.settings_agents import AgentConfig, Placement
from torpor.settings_callers import SourceConfig, TenantConfig, verifying_secrets
from torpor.settings_inputs import (
    _INPUTS,
    _config_path,
    _Environment,
    _FlatKeys,
    _Inputs,
    _LegacyEnvironment,
    _reading,
    _TomlFile,
    load_toml,
)
from torpor.settings_secrets import resolve_secret, shown_url
from torpor.settings_sections import (
    CONSOLE_KEY_MIN_BYTES,
    BatchSettings,
    LeaseSettings,
    NotificationSettings,
    PoolSettings,
    ReconcilerSettings,
    RuntimeSettings,
    S3Settings,
    SecuritySettings,
    StorageSettings,
    _check_console_key,
)
from torpor.storage_urls import local_folder
from torpor.webhooks.capability import check_key
from torpor.webhooks.signing import decode_key, signed_shape

__all__ = [
    "CONSOLE_KEY_MIN_BYTES",
    "ENV_NESTING",
    "ENV_PREFIX",
    "RESERVED_SOURCE_NAMES",
    "AgentConfig",
    "BatchSettings",
    "LeaseSettings",
    "NotificationSettings",
    "Placement",
    "PoolSettings",
    "ReconcilerSettings",
    "RuntimeSettings",
    "S3Settings",
    "SecuritySettings",
    "Settings",
    "SourceConfig",
    "StorageSettings",
    "TenantConfig",
    "load_toml",
    "resolve_secret",
    "shown_url",
    "verifying_secrets",
]


ENV_PREFIX = "TORPOR_"
ENV_NESTING = "__"
# Sources torpor's own inbox events carry (cancel, retry, dispatch failures; capability
# callbacks): a configured webhook source may not take these names.
RESERVED_SOURCE_NAMES = frozenset({"torpor", "capability"})


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
            if problem := not_a_name("source name", name):
                raise ValueError(problem + ": it names objects in storage")
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
            if problem := not_a_name("tenant name", name):
                raise ValueError(problem + ": it names objects in storage")
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
        object_store = self.storage.object_store_url
        return local_folder(object_store) is not None or self.index_scheme() == "sqlite"

    def index_scheme(self) -> str | None:
        """The scheme of the index's URL (``"redis"``, ``"sqlite"``, ...), an ``env:`` one
        read from its variable: an ``env:`` URL naming SQLite or memory storage was let
        through the refusals for one host (``storage.factory.check_embedded_allowed``).
        None where the variable is not set in this process: the process that opens the
        index resolves it, and refuses it then. The scheme only: the rest may hold a
        password."""
        url = self.storage.index_url
        if url.startswith("env:"):
            try:
                url = resolve_secret(url)
            except ConfigError:
                return None
        scheme, colon, _ = url.partition(":")
        return scheme.lower() if colon else None
