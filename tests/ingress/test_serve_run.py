"""The app starts the conventional ways: ``serve run deploy/serve_config.yaml`` and
``serve run serve_app:build_app config=…``, each as a real subprocess.

Both run against one private Ray head (its own temp dir, so no other Ray on the machine
finds it) and the embedded storage defaults under a temp folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.s3_server import free_port

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEADLINE_S = 180.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORPOR_", "RAY_ADDRESS"))}
    env["RAY_AUTH_MODE"] = "disabled"  # a private test cluster, reached from this host only
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _stop(process: subprocess.Popen[bytes], grace_s: float = 60.0) -> bool:
    """Ctrl-C, as an operator would; kill the process group if it does not go. Whether
    Ctrl-C stopped it (a process that had already exited counts as stopped)."""
    if process.poll() is not None:
        return True
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return False


def _answers(url: str, process: subprocess.Popen[bytes], log: Path) -> dict[str, object]:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{process.args} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                body: dict[str, object] = json.loads(response.read())
                return body
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)  # polling a server that is starting: no event to wait on
    pytest.fail(f"{url} did not answer in {DEADLINE_S} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """A private Ray head for the two ``serve run`` commands; stopped with its processes."""
    temp = Path(tempfile.mkdtemp(prefix="tp-", dir="/tmp"))  # short: Ray's socket paths
    gcs = free_port()
    ports = [
        "--port", str(gcs),
        "--ray-client-server-port", str(free_port()),
        "--dashboard-agent-listen-port", str(free_port()),
        "--dashboard-agent-grpc-port", str(free_port()),
        "--runtime-env-agent-port", str(free_port()),
        "--metrics-export-port", str(free_port()),
        "--dashboard-port", str(free_port()),
    ]  # fmt: skip
    log = temp / "head.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
             "--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
             *ports],
            env=_env(), cwd=temp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    address = f"127.0.0.1:{gcs}"
    deadline = time.monotonic() + DEADLINE_S
    while b"Ray runtime started" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # waiting on another process's log line
    yield address
    _stop(process)


# Run as a driver of its own (this test process has its own Ray): Serve shut down on the
# head, every app deleted, and its controller gone, before the next ``serve run``. A
# ``serve run`` stopped with Ctrl-C shuts Serve down itself, but one killed at the end of
# its grace (a loaded machine; a runner that ignored SIGINT, before ``tests/conftest.py``
# gave it back) left its app, and the next found the route still taken ("Prefix / is
# being used by application torpor", seen in CI).
_SERVE_GONE = """
import sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False)
serve.shutdown()
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    except ValueError:
        sys.exit(0)
    time.sleep(0.5)  # a named actor being killed: no event to wait on from here
sys.exit("the Serve controller did not go")
"""


@pytest.fixture
def serve_gone(head: str) -> str:
    """The head, with no Serve on it: each test starts its app on a clean slate."""
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_GONE, head, str(DEADLINE_S / 2)],
        env=_env(), cwd=ROOT, capture_output=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return head


def _config(tmp: Path) -> Path:
    config = tmp / "torpor.toml"
    config.write_text(
        # One namespace per app: the detached reconciler of a namespace outlives its app
        # and sweeps the storage it was started with.
        f'namespace = "serverun{os.getpid()}{tmp.name[-12:].replace("_", "")}"\n'
        "[storage]\n"
        f'object_store_url = "file://{tmp / "objects"}"\n'
        f'index_url = "sqlite://{tmp / "index.db"}"\n'
    )
    return config


def _serve_run(address: str, tmp: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(BIN / "serve"), "run", "--address", address, *args],
            env=_env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return process, log


def test_serve_run_with_the_deploy_config_starts_the_app(serve_gone: str, tmp_path: Path) -> None:
    head = serve_gone
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    config["proxy_location"] = "HeadOnly"
    [app] = config["applications"]
    app["args"]["config"] = str(_config(tmp_path))
    for deployment in app["deployments"]:
        deployment["num_replicas"] = 1  # two cores
    serve_config = tmp_path / "serve_config.yaml"
    serve_config.write_text(yaml.safe_dump(config))
    process, log = _serve_run(head, tmp_path, str(serve_config))
    try:
        assert _answers(f"http://127.0.0.1:{port}/healthz", process, log)["ok"] is True
    finally:
        stopped = _stop(process)
    assert stopped, f"serve run ignored Ctrl-C for 60 s:\n{log.read_text()[-3000:]}"


def test_serve_run_with_the_builder_and_a_config_argument_starts_the_app(
    serve_gone: str, tmp_path: Path
) -> None:
    head = serve_gone
    # `serve run IMPORT_PATH` has no port option: it uses the Serve already running.
    port = free_port()
    subprocess.run(
        [str(BIN / "serve"), "start", "--address", head, "--http-host", "127.0.0.1",
         "--http-port", str(port)],
        env=_env(), cwd=ROOT, check=True, capture_output=True, timeout=DEADLINE_S,
    )  # fmt: skip
    process, log = _serve_run(head, tmp_path, "serve_app:build_app", f"config={_config(tmp_path)}")
    try:
        assert _answers(f"http://127.0.0.1:{port}/healthz", process, log)["ok"] is True
    finally:
        stopped = _stop(process)
    assert stopped, f"serve run ignored Ctrl-C for 60 s:\n{log.read_text()[-3000:]}"
