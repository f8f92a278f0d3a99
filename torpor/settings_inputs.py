"""Where settings are read from (``torpor.settings``): keyword arguments, ``TORPOR_*``
variables from a given environment, 0.1's flat variables and the TOML file, each moving
0.1's flat keys into their sections; and which environment and file the next
``Settings()`` reads."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from torpor.errors import ConfigError
from torpor.settings_compat import legacy_environment, upgrade_flat_keys
from torpor.settings_sections import S3Settings


@dataclass(frozen=True)
class _Inputs:
    environ: Mapping[str, str]
    toml: Path | None


# Which environment and file the next Settings() reads; set by from_env/build, so the
# source hooks (class methods, no arguments) see the caller's choice.
_INPUTS: ContextVar[_Inputs | None] = ContextVar("torpor_settings_inputs", default=None)


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
