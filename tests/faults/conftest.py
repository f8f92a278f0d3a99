"""Fault-injection fixtures: a fault proxy in front of the S3 test server, and a Redis
server of the test's own to pause and flush."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis

from storage.s3_store import S3ObjectStore
from tests.support.fault_proxy import FaultProxy
from tests.support.s3_server import S3TestServer, free_port


@pytest.fixture
def s3_proxy(s3_server: S3TestServer, s3_bucket: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.endpoint).start()
    yield proxy
    proxy.stop()


@pytest.fixture
async def faulty_s3(
    s3_server: S3TestServer, s3_proxy: FaultProxy, s3_bucket: str
) -> AsyncIterator[S3ObjectStore]:
    kwargs = {**s3_server.boto_kwargs(), "endpoint_url": s3_proxy.endpoint}
    store = S3ObjectStore(s3_bucket, "f", **kwargs)
    yield store
    await store.close()


@dataclass
class DedicatedRedis:
    """A redis-server of this test's own, so it can be paused (SIGSTOP) and flushed."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def flush(self) -> None:
        redis.Redis(port=self.port).flushall()


@pytest.fixture
def dedicated_redis() -> Iterator[DedicatedRedis]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.05)  # start-up of a server process, not test time
    client.close()
    server = DedicatedRedis(process, port)
    yield server
    server.resume()
    process.kill()
    process.wait()
