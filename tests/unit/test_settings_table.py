"""The README's settings table is generated from the ``Field(description=…)`` of every
setting; this test fails when the two differ (a field added, renamed or redescribed).

Regenerate with ``make settings-table`` (``python -m tests.unit.test_settings_table``).
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from torpor.settings import ENV_NESTING, ENV_PREFIX, Settings

README = Path(__file__).resolve().parents[2] / "README.md"
START = "<!-- settings-table: generated from torpor/settings.py by `make settings-table` -->"
END = "<!-- end settings-table -->"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds directly, if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _mapped_model(annotation: Any) -> type[BaseModel] | None:
    """The model a ``dict[str, Model]`` field holds per key, if that is what it is."""
    if get_origin(annotation) is dict:
        return _model_in(get_args(annotation)[1])
    return None


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None or value in ([], {}):
        return ""
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def rows(model: type[BaseModel], path: str = "", env: str | None = ENV_PREFIX) -> list[str]:
    """One table row per leaf setting: dotted name, variable, default, description."""
    out: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{path}{name}"
        variable = f"{env}{name.upper()}" if env is not None else None
        section = _model_in(field.annotation)
        mapped = _mapped_model(field.annotation)
        # torpor's own sections (torpor.settings and its parts, torpor.settings_*) nest.
        if section is not None and section.__module__.startswith(Settings.__module__):
            nested = f"{variable}{ENV_NESTING}" if variable else None
            out += rows(section, f"{dotted}.", nested)
        elif mapped is not None:
            out += rows(mapped, f"{dotted}.<name>.", None)
        else:
            shown = f"`{variable}`" if variable else ""
            out.append(f"| `{dotted}` | {shown} | {_default(field)} | {field.description} |")
    return out


def table() -> str:
    head = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    return "\n".join([START, *head, *rows(Settings), END])


def _readme_table() -> str:
    text = README.read_text()
    return text[text.index(START) : text.index(END) + len(END)]


def test_every_setting_is_described() -> None:
    missing = [r for r in rows(Settings) if r.endswith("| None |")]
    assert not missing, missing


def test_readme_settings_table_matches_the_settings() -> None:
    assert _readme_table() == table(), "README settings table is stale: make settings-table"


def write() -> None:
    text = README.read_text()
    README.write_text(text.replace(_readme_table(), table()))


if __name__ == "__main__":
    write()
    sys.exit(0)
