"""``torpor reconcile`` against a real local Ray: it waits for the sweep with a deadline,
and never starts a reconciler of its own.

The command runs as an operator runs it (``python -m torpor`` in a subprocess), attached
to this module's Ray by its address. The reconciler that does not answer is an actor of
the reconciler's name whose ``sweep_once`` never returns: what a stuck one looks like
from the outside.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from actors.reconciler import NAME
from torpor import cli

ROOT = Path(__file__).resolve().parents[2]


@ray.remote(num_cpus=0)
class StuckReconciler:
    async def sweep_once(self) -> dict[str, int]:
        await asyncio.Event().wait()  # never set: the sweep never ends
        return {}


@pytest.fixture
def namespace(ray_cluster: None) -> Iterator[str]:
    name = "t" + secrets.token_hex(4)
    yield name
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == name:
            ray.kill(ray.get_actor(actor["name"], namespace=name), no_restart=True)


def reconcile(namespace: str, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # This process's environment carries Ray's authentication mode to the command.
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORPOR_")}
    address = ray.get_runtime_context().gcs_address
    return subprocess.run(
        [sys.executable, "-m", "torpor", "reconcile", "--address", address, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
        timeout=120,  # the command before its deadline: this, and the test fails
        env={**base, "TORPOR_NAMESPACE": namespace, "PYTHONPATH": str(ROOT)},
    )


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("torpor: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_a_reconciler_that_does_not_answer_fails_the_command_at_its_deadline(
    namespace: str, tmp_path: Path
) -> None:
    stuck = StuckReconciler.options(  # type: ignore[attr-defined]
        name=NAME, namespace=namespace, lifetime="detached"
    ).remote()
    ray.get(stuck.__ray_ready__.remote(), timeout=60)
    started = time.monotonic()
    result = reconcile(namespace, tmp_path, "--timeout-s", "2")
    took = time.monotonic() - started
    assert result.returncode == cli.EXIT_UNREACHABLE, result.stderr
    assert "the reconciler did not answer within 2 s" in error_line(result)
    assert result.stdout == ""
    assert took < 60, f"the command took {took:.1f} s"


def test_with_no_reconciler_the_command_says_so_and_starts_none(
    namespace: str, tmp_path: Path
) -> None:
    result = reconcile(namespace, tmp_path)
    assert result.returncode == cli.EXIT_UNREACHABLE, result.stderr
    assert f"no reconciler runs in namespace {namespace!r}" in error_line(result)
    # Made by the command, a detached reconciler swept on after it, on its configuration.
    with pytest.raises(ValueError):
        ray.get_actor(NAME, namespace=namespace)


def test_a_timeout_that_is_no_duration_is_a_usage_error() -> None:
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(SystemExit) as exit_:
            cli.parser().parse_args(["reconcile", "--timeout-s", bad])
        assert exit_.value.code == cli.EXIT_USAGE
