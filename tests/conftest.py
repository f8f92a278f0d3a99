"""Shared fixtures: real Redis, a real S3 HTTP endpoint (moto's server), local folders.

Nothing here is skipped: a missing Redis is a failed run, and ``.ci/run`` starts one.
Each test gets a Redis key prefix of its own, deleted afterwards, and a wiped S3 server.
"""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import signal
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from storage.local_store import LocalObjectStore
from storage.memory_index import MemoryIndex
from storage.memory_store import MemoryObjectStore
from storage.redis_index import RedisIndex
from storage.s3_store import S3ObjectStore
from storage.sqlite_index import SqliteIndex
from tests.support.s3_server import S3TestServer

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
BUCKET = "torpor-test"

# The declared markers, applied here so nobody has to remember them: by the service
# fixtures a test uses (directly or through other fixtures), and for Ray by folder or by a
# module that starts Ray itself. ``-m "not ray and not redis and not s3"`` then needs no
# service at all, and ``-m "not ray"`` is the fast inner loop.
_MARK_BY_FIXTURE = {
    "redis_url": "redis",
    "redis_index": "redis",
    "redis_prefix": "redis",
    "s3_server": "s3",
    "s3_store": "s3",
    "s3_bucket": "s3",
}
_RAY_FOLDERS = {"ray", "ingress", "multinode", "e2e"}
_TESTS = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    # A run started in the background by a non-interactive shell (``cmd &`` in a script,
    # ``nohup``) inherits SIGINT ignored, and so does every process the tests start: a
    # ``torpor serve``, ``serve run`` or ``ray start`` stopped with Ctrl-C then ignores it
    # and is killed at the end of its 60 s grace (five times a run: 17.5 minutes against
    # 11.7 without, seen here). The tests send Ctrl-C as an operator's terminal does to
    # its foreground job, whose SIGINT is never ignored; an exec resets a handler, not an
    # ignore, so the runner's own default handler is what its children start with.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _starts_ray(path: Path, cache: dict[Path, bool]) -> bool:
    if path not in cache:
        cache[path] = "ray.init(" in path.read_text(encoding="utf-8")
    return cache[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    starts_ray: dict[Path, bool] = {}
    for item in items:
        marks = {
            _MARK_BY_FIXTURE[f] for f in getattr(item, "fixturenames", ()) if f in _MARK_BY_FIXTURE
        }
        path = Path(item.path)
        folder = path.relative_to(_TESTS).parts[0] if path.is_relative_to(_TESTS) else ""
        if folder in _RAY_FOLDERS or _starts_ray(path, starts_ray):
            marks.add("ray")
        if folder == "browser":
            marks.add("browser")
        for name in sorted(marks):
            item.add_marker(name)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Ray's own code in this process (node start-up, its clients) leaves sockets in
    # reference cycles now and then; the garbage collector then closes one whenever it
    # runs, inside some later test, and the ResourceWarning fails that test (seen once in
    # 1,500: at the setup of a test in tests/ray/test_ray_work.py). Collected here, before
    # each test of a module that starts Ray, with that warning ignored. Leaks of our own
    # code still fail: the same code runs in the modules without Ray.
    if item.get_closest_marker("ray") is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


@pytest.fixture(scope="session")
def redis_url() -> str:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:  # fail loudly: CI must provide Redis
        raise RuntimeError(f"tests need Redis at {REDIS_URL} (set REDIS_URL)") from exc
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"tptest:{secrets.token_hex(4)}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
async def redis_index(redis_url: str, redis_prefix: str) -> AsyncIterator[RedisIndex]:
    index = RedisIndex(redis_url, prefix=redis_prefix)
    yield index
    await index.close()


@pytest.fixture
async def sqlite_index(tmp_path: Path) -> AsyncIterator[SqliteIndex]:
    index = SqliteIndex(tmp_path / "index.db")
    yield index
    await index.close()


@pytest.fixture
async def memory_index() -> AsyncIterator[MemoryIndex]:
    index = MemoryIndex()
    yield index
    await index.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3TestServer]:
    server = S3TestServer().start()
    yield server
    server.stop()


def make_bucket(server: S3TestServer, bucket: str = BUCKET) -> None:
    server.create_bucket(bucket)


@pytest.fixture
def s3_bucket(s3_server: S3TestServer) -> str:
    s3_server.reset()
    make_bucket(s3_server)
    return BUCKET


@pytest.fixture
async def s3_store(s3_server: S3TestServer, s3_bucket: str) -> AsyncIterator[S3ObjectStore]:
    store = S3ObjectStore(s3_bucket, "t", **s3_server.boto_kwargs())
    yield store
    await store.close()


@pytest.fixture
async def local_store(tmp_path: Path) -> AsyncIterator[LocalObjectStore]:
    store = LocalObjectStore(tmp_path / "objects")
    yield store
    await store.close()


@pytest.fixture
async def memory_store() -> AsyncIterator[MemoryObjectStore]:
    store = MemoryObjectStore()
    yield store
    await store.close()


async def eventually(
    predicate: object, *, timeout_s: float = 20.0, interval_s: float = 0.05, what: str = ""
) -> None:
    """Wait for ``predicate()`` (sync or async) to be truthy, or fail after the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate() if callable(predicate) else predicate
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s: {what}")
        await asyncio.sleep(interval_s)


# A hang is reported with the await chain of every task, not only the event loop's frame:
# pytest-timeout (300 s, pyproject) ends the test, and shortly before that this watchdog
# prints where each coroutine of the running loop is waiting.
_HANG_REPORT_S = 240.0


def _print_task_stacks() -> None:
    import gc
    import sys

    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            print(f"\n--- still running after {_HANG_REPORT_S:g} s ---", file=sys.stderr)
            for task in list(asyncio.all_tasks(obj)):
                task.print_stack(file=sys.stderr)


@pytest.fixture(autouse=True)
def _hang_report() -> Iterator[None]:
    import threading

    timer = threading.Timer(_HANG_REPORT_S, _print_task_stacks)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
