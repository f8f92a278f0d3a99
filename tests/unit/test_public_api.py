"""The curated public API: ``from torpor import *`` gives exactly the listed names, and
importing the package pulls in neither Ray nor the client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torpor

ROOT = Path(__file__).resolve().parents[2]


def test_star_import_gives_every_public_name() -> None:
    namespace: dict[str, object] = {}
    exec("from torpor import *", namespace)
    exported = {k for k in namespace if not k.startswith("__") or k == "__version__"}
    assert exported == set(torpor.__all__)
    for name in torpor.__all__:
        assert namespace[name] is not None, name


def test_every_public_name_is_the_defining_modules_object() -> None:
    from torpor.client import Client
    from torpor.errors import TorporError
    from torpor.settings import Settings
    from torpor.tools import LongRunningTool, WaitPlan, sync_tool

    assert torpor.Client is Client and torpor.Settings is Settings
    assert torpor.LongRunningTool is LongRunningTool and torpor.WaitPlan is WaitPlan
    assert torpor.sync_tool is sync_tool and torpor.TorporError is TorporError
    assert set(torpor.__all__) == {*torpor._EXPORTS, "__version__"}


def test_unknown_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="activation_internals"):
        torpor.activation_internals  # type: ignore[attr-defined]  # noqa: B018


def test_importing_torpor_imports_no_ray_and_no_client() -> None:
    probe = (
        "import sys, torpor; from torpor import Settings, WaitPlan; "
        "assert 'ray' not in sys.modules, 'ray'; "
        "assert 'torpor.client' not in sys.modules, 'client'; print('clean')"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
