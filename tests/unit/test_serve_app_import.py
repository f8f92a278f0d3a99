"""Importing ``serve_app`` builds nothing: no Ray, no Serve, no configuration read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import os, sys

class Spy(dict):
    reads = []
    def _note(self, key):
        if str(key).startswith("TORPOR_"):
            Spy.reads.append(key)
    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)
    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)
    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

os.environ = Spy(os.environ)
import ray
import serve_app
from ray import serve

assert not ray.is_initialized(), "importing serve_app started Ray"
assert not hasattr(serve_app, "app"), "serve_app builds an app at import"
assert not Spy.reads, f"importing serve_app read {Spy.reads}"
assert callable(serve_app.build_app)
print("clean")
"""


def test_importing_serve_app_starts_nothing_and_reads_no_configuration() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORPOR_CONFIG": "/nonexistent/torpor.toml"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip().endswith("clean")


def test_the_app_starts_the_reconciler_from_one_singleton_deployment() -> None:
    # Serve's own graph walk (no Ray needed): which deployments the app would run.
    from ray.serve._private.build_app import build_app

    from serve_app import application
    from torpor.settings import Settings

    settings = Settings.build({})
    built = build_app(application(settings), name="torpor")
    assert {d.name: d.num_replicas for d in built.deployments} == {
        "ReconcilerStarter": 1,
        "Ingress": 1,
    }
    quiet = build_app(application(settings, start_reconciler=False), name="torpor")
    assert [d.name for d in quiet.deployments] == ["Ingress"]


def test_the_app_runs_as_many_ingress_replicas_as_asked() -> None:
    from ray.serve._private.build_app import build_app

    from serve_app import application
    from torpor.errors import ConfigError
    from torpor.settings import Settings

    settings = Settings.build({})
    built = build_app(application(settings, replicas=2), name="torpor")
    assert {d.name: d.num_replicas for d in built.deployments}["Ingress"] == 2
    with pytest.raises(ConfigError):
        application(settings, replicas=0)
