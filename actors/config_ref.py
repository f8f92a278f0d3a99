"""How a Ray actor or Serve replica gets its settings without secrets in its arguments.

Whatever is passed to ``.remote(...)`` or ``.bind(...)`` is pickled into Ray's control
store and stays there. So actors are handed a :class:`ConfigRef`, not resolved
:class:`Settings`: either the TOML path to read in their own process
(``Settings.from_env``, with that process's environment), or the settings as data whose
secrets are ``env:NAME`` references, resolved only where they are used. An inline
secret, or a storage URL with a password in it, is refused here with a message that says
how to write it instead; ``security.inline_secrets_in_ray`` lets tests and throwaway demos
through (their secrets then persist in Ray's control store).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, SecretStr

from torpor.errors import ConfigError
from torpor.settings import Settings


@dataclass(frozen=True)
class ConfigRef:
    """A TOML path to read (None: ``$TORPOR_CONFIG``), or settings data without secrets."""

    config_path: str | None = None
    data: dict[str, Any] | None = None

    @classmethod
    def from_file(cls, config_path: str | None) -> ConfigRef:
        """The receiving process reads the file and its own environment itself."""
        return cls(config_path=config_path)

    @classmethod
    def of(cls, settings: Settings | ConfigRef) -> ConfigRef:
        """``settings`` as data; ConfigError if a secret would travel with it."""
        if isinstance(settings, ConfigRef):
            return settings
        if not settings.security.inline_secrets_in_ray:
            for where in inline_secrets(settings):
                raise ConfigError(
                    f"{where} holds a secret that Ray would store with the actor's arguments: "
                    'write it as "env:NAME" (set NAME where the actors run) or load the '
                    "settings from a file the actors read (serve_app:build_app config=...)"
                )
        return cls(data=_raw(settings))

    @classmethod
    def of_loaded(cls, settings: Settings, config_path: str | None = None) -> ConfigRef:
        """For settings the caller read with ``Settings.from_env(config_path=...)``: as
        data when nothing secret is inline (every receiver then sees the same settings),
        else as the path, which each receiver reads with its own environment (so
        ``TORPOR_*`` variables must be set where the actors run, not only here)."""
        if inline_secrets(settings) and not settings.security.inline_secrets_in_ray:
            return cls.from_file(config_path or os.environ.get("TORPOR_CONFIG"))
        return cls.of(settings)

    def load(self) -> Settings:
        """The settings, built in the process that calls this (``env:`` left unresolved)."""
        if self.data is None:
            return Settings.from_env(config_path=self.config_path)
        return Settings.build(self.data)


def inline_secrets(settings: Settings) -> list[str]:
    """Where ``settings`` holds a secret value itself: a SecretStr that is not ``env:``,
    or a storage URL with a password."""
    found = [where for where, raw in _secrets(settings, "") if not raw.startswith("env:")]
    for name in ("index_url", "object_store_url"):
        url = getattr(settings.storage, name)
        if not url.startswith("env:") and _has_password(url):
            found.append(f"storage.{name}")
    # An agent's or a tool's options are plain data: a key written in them as it is (an
    # LLM's api_key, a header's token) went to Ray with the rest, unseen.
    for agent, config in settings.agents.items():
        found += _named_secrets(config.options, f"agents.{agent}.options")
        for tool, options in config.tool_options.items():
            found += _named_secrets(options, f"agents.{agent}.tool_options.{tool}")
    return found


_SECRET_NAME = re.compile(
    r"(^|[_-])(api[_-]?key|access[_-]?key|secret|password|passwd|token|authorization)$",
    re.IGNORECASE,
)


def _named_secrets(value: object, where: str) -> list[str]:
    """Where an option named like a credential holds a value itself, not ``env:NAME``."""
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            here = f"{where}.{k}"
            if isinstance(v, str) and _SECRET_NAME.search(str(k)):
                if v.strip() and not v.startswith("env:"):
                    found.append(here)
            else:
                found += _named_secrets(v, here)
        return found
    if isinstance(value, list | tuple):
        return [f for i, v in enumerate(value) for f in _named_secrets(v, f"{where}[{i}]")]
    return []


def _has_password(url: str) -> bool:
    """A password in the URL's userinfo, or in its query (redis-py reads ``?password=``)."""
    parts = urlsplit(url)
    return bool(parts.password) or "password" in parse_qs(parts.query)


def _secrets(value: object, where: str) -> list[tuple[str, str]]:
    if isinstance(value, SecretStr):
        return [(where, value.get_secret_value())]
    if isinstance(value, BaseModel):
        return [
            found
            for name in type(value).model_fields
            for found in _secrets(getattr(value, name), f"{where}.{name}".lstrip("."))
        ]
    if isinstance(value, dict):
        return [f for k, v in value.items() for f in _secrets(v, f"{where}.{k}")]
    if isinstance(value, list | tuple):
        return [f for i, v in enumerate(value) for f in _secrets(v, f"{where}[{i}]")]
    return []


def settings_digest(settings: Settings) -> str:
    """Which settings a process runs with, as a digest another process can compare with
    its own: every field, defaults included, secrets as written (a rotated inline one
    differs). Compared over Ray calls only; never logged, never in a name."""
    data = json.dumps(_raw(settings, every=True), sort_keys=True, default=str)
    return hashlib.sha256(data.encode()).hexdigest()


def _raw(value: Any, *, every: bool = False) -> Any:
    """A model dump that keeps secrets as written (``env:NAME``), not masked; the fields
    set and nested models (``every``: all fields)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, BaseModel):
        return {
            name: _raw(getattr(value, name), every=every)
            for name in type(value).model_fields
            if every
            or name in value.model_fields_set
            or isinstance(getattr(value, name), BaseModel)
        }
    if isinstance(value, dict):
        return {k: _raw(v, every=every) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_raw(v, every=every) for v in value]
    return value
