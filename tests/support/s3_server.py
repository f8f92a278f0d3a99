"""moto's standalone S3 server in its own process, reached over real HTTP through boto3.

moto checks S3 conditional-write preconditions and then writes, without a lock, so two
racing requests can both pass ``If-None-Match: *``. Real S3 and MinIO evaluate the
precondition atomically; to give the tests the semantics of the real service, this
launcher serialises mutating requests (PUT/POST/DELETE) with one lock and leaves reads
concurrent.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _serialise_writes(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    lock = threading.Lock()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") in {"PUT", "POST", "DELETE"}:
            with lock:
                return list(app(environ, start_response))
        return app(environ, start_response)

    return wrapped


def main() -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(
        "127.0.0.1",
        args.port,
        _serialise_writes(app),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range and Ray's worker ports (as
    the demo's, ``quiet_port``): one the kernel hands out (bind to 0) is free when chosen,
    but any process's next outgoing connection (a Redis client's, one of Ray's own as it
    starts) may take it as its source port before the server chosen for it binds it."""
    from torpor.entry.ports import quiet_port

    return quiet_port()


class S3TestServer:
    """Start/stop the server; ``reset()`` wipes every bucket between tests."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> S3TestServer:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.s3_server", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("the S3 test server exited at start-up")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the S3 test server did not answer within {timeout_s}s")

    def reset(self) -> None:
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def boto_kwargs(self) -> dict[str, str]:
        return {
            "endpoint_url": self.endpoint,
            "region": "us-east-1",
            "access_key_id": "testing",
            "secret_access_key": "testing",
        }

    def create_bucket(self, bucket: str) -> None:
        import boto3  # ~100 ms: only the callers that make a bucket pay for it

        kwargs = self.boto_kwargs()
        client = boto3.client(
            "s3",
            endpoint_url=kwargs["endpoint_url"],
            region_name=kwargs["region"],
            aws_access_key_id=kwargs["access_key_id"],
            aws_secret_access_key=kwargs["secret_access_key"],
        )
        client.create_bucket(Bucket=bucket)
        client.close()


if __name__ == "__main__":
    main()
