"""A blocking ``Client`` made in a program's main thread gives it Ray's SIGTERM handler,
as ``ray.init`` there would: a program stopped with SIGTERM (a container's stop, a
scheduler's cancel) exits through ``sys.exit``, so its ``atexit`` work (``ray.shutdown``
among it) runs, for as long as it takes: Ray's connect also put abseil's failure handler in
front of SIGTERM, which aborted (SIGABRT, -6) any exit still running three seconds on
(actors/driver.py). The client used to call ``ray.init`` on its private loop's thread, where
Ray sets no handler and warns so: SIGTERM then killed the program outright. A handler the
program set itself stays. The CLI (``torpor serve``, ``torpor reconcile``) connects the
same way; a Client made after the program's own ``ray.init`` takes abseil off too; and a
program disconnected with ``shutdown_driver`` (the demo's end) still exits through it.

Real programs in processes of their own (each its own local Ray, the machine's Redis)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.ray.conftest import ROOT

PROGRAM = """
import atexit, pathlib, signal, sys, time
from torpor.client import Client
from torpor.settings import Settings

folder, redis_url, prefix, mode = sys.argv[1:5]
folder = pathlib.Path(folder)
if mode == "own":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
# Longer than the three seconds abseil's SIGTERM handler gave an exit before it aborted.
atexit.register(lambda: (time.sleep(4), (folder / "atexit").write_text("ran")))
settings = Settings.build({
    "namespace": prefix,
    "storage": {"object_store_url": "file://" + str(folder / "objects"),
                "index_url": redis_url, "redis_prefix": prefix},
})
if mode == "cli":  # how `torpor serve` and `torpor reconcile` connect
    from torpor.cli_cluster import _ray_init
    _ray_init(address="local", namespace=prefix, log_to_driver=False)
elif mode == "shutdown":  # the demo's end: disconnected, the program goes on
    from actors.driver import init_driver, shutdown_driver
    init_driver(address="local", namespace=prefix, log_to_driver=False)
    shutdown_driver()
else:
    if mode == "preconnected":  # the program's own connect, as README's scan.py has it
        import ray
        ray.init(address="local", namespace=prefix, log_to_driver=False)
    client = Client(settings, address="local", start_reconciler=False)
(folder / "connected").write_text("yes")
time.sleep(300)
"""
CONNECT_S = 120.0  # a local Ray's start on a loaded 2-core machine


async def stopped(folder: Path, redis_url: str, prefix: str, mode: str) -> tuple[int, str]:
    """The program started, connected, sent SIGTERM: its exit code and its stderr."""
    err = folder / "stderr"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with err.open("w") as sink:
        program = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, str(folder), redis_url, prefix, mode],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )

        def connected() -> bool:
            assert program.poll() is None, err.read_text()[-2000:]  # died: say why
            return (folder / "connected").exists()

        try:
            await eventually(connected, timeout_s=CONNECT_S, what="the client connected")
            program.send_signal(signal.SIGTERM)
            code = program.wait(timeout=120)
        finally:
            if program.poll() is None:
                program.kill()
                program.wait()
    return code, err.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["client", "preconnected", "cli", "shutdown"])
async def test_a_connected_program_exits_through_its_atexit_work_on_sigterm(
    tmp_path: Path, redis_url: str, redis_prefix: str, mode: str
) -> None:
    code, err = await stopped(tmp_path, redis_url, redis_prefix, mode)
    # Ray's handler exits with the signal's number (``sys.exit(15)``); without it the
    # signal killed the process (-15) and nothing registered with ``atexit`` ran, as it
    # did after a ``ray.shutdown``, which set the kernel's handler back to the default;
    # with abseil's in front, an exit longer than three seconds was aborted (-6).
    assert code == signal.SIGTERM, (code, err[-2000:])
    assert (tmp_path / "atexit").exists(), "the program's atexit work did not run"
    assert "SIGTERM handler is not set" not in err
    # abseil's handler printed a stack for the stop before it armed its abort (only the
    # program's own: its Ray's workers, which ``ray.shutdown`` stops with SIGTERM too, do
    # not log to this driver, ``log_to_driver=False``).
    assert "SIGTERM received" not in err, err[-2000:]


@pytest.mark.slow
async def test_a_programs_own_sigterm_handler_stays_after_a_client_connects(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    code, err = await stopped(tmp_path, redis_url, redis_prefix, "own")
    assert code == 42, (code, err[-2000:])  # the program's handler's, not Ray's 15
