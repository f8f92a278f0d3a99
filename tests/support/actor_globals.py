"""Module globals as a Ray actor class's methods read them, for tests that drive the class
directly (no actor) and patch what its methods look up.

Once a Ray has run in the test process (an earlier test module's), the methods of an
actor class made at import can read a copy of their module's globals: Ray wraps them (its
tracing hook) around functions whose ``__globals__`` is not the module's own dict. A
``monkeypatch.setattr`` on the module then never reaches the method, and the test runs
the real thing (seen in a whole-suite run, never in the module alone).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def globals_of(cls: type) -> list[dict[str, Any]]:
    """Every globals dict the functions of ``cls`` (and the functions they close over:
    Ray's wrappers) read."""
    found: dict[int, dict[str, Any]] = {}
    seen: set[int] = set()
    stack: list[Any] = []
    for value in vars(cls).values():
        stack.append(getattr(value, "__func__", value))
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        scope = getattr(fn, "__globals__", None)
        if isinstance(scope, dict):
            found[id(scope)] = scope
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(inner):
                stack.append(inner)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            stack.append(wrapped)
    return list(found.values())


def patch_global(
    monkeypatch: pytest.MonkeyPatch, cls: type, module: ModuleType, name: str, value: Any
) -> None:
    """``module.name = value`` for the test, wherever the methods of ``cls`` read it."""
    monkeypatch.setattr(module, name, value, raising=False)
    for scope in globals_of(cls):
        if scope is not vars(module) and scope.get("__name__") == module.__name__:
            monkeypatch.setitem(scope, name, value)
