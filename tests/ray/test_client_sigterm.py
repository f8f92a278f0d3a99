"""A blocking ``Client`` in a program's main thread leaves Ray's SIGTERM handler in place:
a program stopped with SIGTERM (a container's stop, a scheduler's cancel) exits through
``sys.exit``, so ``ray.shutdown`` runs and the local Ray it started stops with it. The
client used to call ``ray.init`` on its private loop's thread, where Ray sets no handler
(and warns so): SIGTERM then killed the program outright.

A real program in a process of its own (its own local Ray, the machine's Redis)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray.conftest import ROOT

PROGRAM = """
import sys, time
from torpor.client import Client
from torpor.settings import Settings

objects, redis_url, prefix = sys.argv[1:4]
settings = Settings.build({
    "namespace": prefix,
    "storage": {"object_store_url": "file://" + objects, "index_url": redis_url,
                "redis_prefix": prefix},
})
client = Client(settings, start_reconciler=False)
print("connected", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_a_program_with_a_client_stops_cleanly_on_sigterm(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    program = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "objects"), redis_url, redis_prefix],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert program.stdout is not None
        line = program.stdout.readline()  # blocks until connected (or the program died)
        assert line.strip() == "connected", program.communicate(timeout=60)
        program.send_signal(signal.SIGTERM)
        _, err = program.communicate(timeout=120)
    finally:
        if program.poll() is None:
            program.kill()
            program.wait()
    # Ray's handler exits with the signal's number (``sys.exit(15)``); without it the
    # signal kills the process (-15).
    assert program.returncode == signal.SIGTERM, (program.returncode, err[-2000:])
    assert "SIGTERM handler is not set" not in err
