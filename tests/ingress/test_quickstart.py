"""The README's "Quick start: your own agent", run as written.

Its files are written into an empty folder and its commands run there, against the real
local Redis: ``torpor serve`` as a subprocess, a submitted session, a signed webhook, the
session COMPLETED. Two changes only, so that the test can share the machine: the port is
a free one instead of 8000, and ``torpor serve`` attaches (``--address``) to a private
Ray head, with a namespace and Redis prefix of its own.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ingress.test_serve_run import BIN, DEADLINE_S, ROOT, _env, _stop
from tests.support.s3_server import free_port

pytestmark = pytest.mark.ray


def section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("### Quick start: your own agent", 1)[1].split("\n## ", 1)[0]


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"```([^\n]*)\n(.*?)```", text, re.S)


def commands() -> list[str]:
    for info, body in blocks(section()):
        if info.strip() == "sh":
            return [line.split("  #")[0].strip() for line in body.splitlines() if line]
    raise AssertionError("the section has its commands")


def exported() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in commands():
        if line.startswith("export "):
            for pair in shlex.split(line[len("export ") :]):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """A private Ray head whose workers see the README's exports, as the local Ray that
    ``torpor serve`` starts in the user's shell would (replicas read ``env:`` secrets)."""
    temp = Path(tempfile.mkdtemp(prefix="tq-", dir="/tmp"))  # short: Ray's socket paths
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
    env = {**_env(), **{k: v for k, v in exported().items() if k != "PYTHONPATH"}}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2",
             "--include-dashboard=false", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
             *ports],
            env=env, cwd=temp, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + DEADLINE_S
    while b"Ray runtime started" not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            pytest.fail(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # waiting on another process's log line
    yield f"127.0.0.1:{gcs}"
    _stop(process)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path  # the user's empty folder


def test_the_readme_quick_start_runs_as_written(
    head: str, folder: Path, redis_url: str, redis_prefix: str
) -> None:
    for info, body in blocks(section()):
        if "file=" in info:
            (folder / info.split("file=", 1)[1].strip()).write_text(body)
    lines = commands()
    port = free_port()
    env = {**_env(), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **exported()}
    env["PYTHONPATH"] = os.pathsep.join([".", str(ROOT)])
    # the port moved from 8000: the CLI's default URL (public_url) moves with it
    env["TORPOR_PUBLIC_URL"] = f"http://127.0.0.1:{port}"
    env["TORPOR_NAMESPACE"] = f"qs{os.getpid()}{folder.name[-8:]}".replace("_", "")
    env["TORPOR_STORAGE__REDIS_PREFIX"] = redis_prefix
    env["TORPOR_STORAGE__INDEX_URL"] = redis_url
    [serve_line] = [c for c in lines if c.startswith("torpor serve")]
    serve_argv = shlex.split(serve_line.rstrip("&").replace("8000", str(port)))
    log = folder / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [*serve_argv, "--address", head],
            env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def torpor(line: str, **subst: str) -> Any:
        for name, value in subst.items():
            line = line.replace(name, value)
        line = line.replace('"$OA_WEBHOOK_SECRET"', env["OA_WEBHOOK_SECRET"])  # the shell's job
        done = subprocess.run(
            shlex.split(line.replace("8000", str(port))),
            env=env, cwd=folder, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"{line}: {done.stderr}"
        return json.loads(done.stdout) if "--json" in line else done.stdout

    try:
        healthy(f"http://127.0.0.1:{port}/healthz", server, log)
        [submit] = [c for c in lines if " submit " in c]
        session = torpor(submit)
        sid = session["session_id"]
        status_lines = [c for c in lines if " status " in c]
        waiting = eventually_state(lambda: torpor(status_lines[0], SESSION_ID=sid), "SUSPENDED")
        correlation = waiting["waits"][0]["correlation_id"]
        [send] = [c for c in lines if c.startswith("torpor send")]
        answer = torpor(send, CORRELATION_ID=correlation)
        assert answer.startswith("202"), answer
        done = eventually_state(lambda: torpor(status_lines[-1], SESSION_ID=sid), "COMPLETED")
        assert done["result"] == {"decision": "approved"}
    finally:
        stopped = _stop(server)
    assert stopped, f"torpor serve ignored Ctrl-C for 60 s:\n{log.read_text()[-3000:]}"


def healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"torpor serve exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.loads(response.read()).get("ok"):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.5)  # polling a server that is starting: no event to wait on
    pytest.fail(f"{url} did not answer in {DEADLINE_S} s:\n{log.read_text()[-3000:]}")


def eventually_state(read: Any, state: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        view = read()
        if view["state"] == state or time.monotonic() > deadline:
            assert view["state"] == state, view
            return view
        time.sleep(0.5)  # another process's state: polled, bounded
