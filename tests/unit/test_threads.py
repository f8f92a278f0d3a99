"""Thread pools of a process's own (``torpor.threads``): a forked child gets its own, and
a name's resolution is timed from when a thread takes it (``torpor.ssrf``)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

from torpor import ssrf
from torpor.errors import ResolversBusy, UnsafeUrl
from torpor.threads import ProcessPool


def test_a_forked_child_runs_calls_in_a_pool_of_its_own() -> None:
    """The parent's threads are not the child's: a pool that counted them as its own
    started none in the child, and every call there waited for ever."""
    pool = ProcessPool(2, "test-fork")

    async def answer() -> int:
        return await asyncio.wait_for(pool.run(lambda: 42), timeout=5)

    assert asyncio.run(answer()) == 42  # the parent's threads exist now
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if the call ran
        try:
            os._exit(0 if asyncio.run(answer()) == 42 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_call_submitted_to_a_pool_that_takes_no_more_work_is_made_in_the_callers_thread() -> None:
    """``submit`` is for work that must be made once asked for. A pool shut down (as
    ``concurrent.futures`` shuts every pool once the interpreter begins to exit) raised
    ``RuntimeError`` instead, out of callers that promise to raise nothing."""
    pool = ProcessPool(1, "test-shut")
    pool.executor().shutdown()
    ran_in: list[int] = []

    def call(x: int) -> int:
        ran_in.append(threading.get_ident())
        return x + 1

    made = pool.submit(call, 41)
    assert made.done() and made.result() == 42
    assert ran_in == [threading.get_ident()]

    def failing() -> None:
        raise ValueError("its own error")

    with pytest.raises(ValueError, match="its own error") as raised:
        pool.submit(failing).result()
    assert raised.value.__cause__ is None and raised.value.__context__ is None


def test_a_thread_that_cannot_start_is_raised_not_made_in_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ThreadPoolExecutor.submit`` queues the call before it starts a thread: a thread
    that cannot start leaves it queued, for a thread already there to make. Made here as
    well, it was made twice."""
    pool = ProcessPool(1, "test-nothread")

    def no_thread(self: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    made: list[int] = []
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.submit(made.append, 1)
    assert made == []


def answering_after(seconds: float) -> ssrf.Resolver:
    def resolve(*_: object, **__: object) -> list[tuple[object, ...]]:
        time.sleep(seconds)
        return [(2, 1, 6, "", ("93.184.216.34", 80))]

    return resolve


async def test_waiting_for_a_resolver_thread_is_not_counted_as_resolving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy threads (LLM calls, other tenants' resolutions) made an instant resolver
    look slow: its callback was refused as not resolving."""
    monkeypatch.setattr(ssrf, "RESOLVERS", ProcessPool(1, "test-dns"))
    release = threading.Event()
    busy = asyncio.ensure_future(ssrf.RESOLVERS.run(release.wait))
    asyncio.get_running_loop().call_later(1.5, release.set)  # the one thread, for 1.5 s
    address = await ssrf.vetted_address(
        "http://hooks.example/", allow_private=False, timeout_s=2.0, resolve=answering_after(1.5)
    )
    assert address == ("93.184.216.34",)  # 3 s in all, each part within its 2 s
    await busy


async def test_no_resolver_thread_free_in_time_is_503_not_the_urls_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ssrf, "RESOLVERS", ProcessPool(1, "test-dns"))
    release = threading.Event()
    busy = asyncio.ensure_future(ssrf.RESOLVERS.run(release.wait))
    try:
        with pytest.raises(ResolversBusy) as refused:
            await ssrf.check_callback("http://hooks.example/", allow_private=False, timeout_s=0.3)
        assert not isinstance(refused.value, UnsafeUrl) and refused.value.status == 503
    finally:
        release.set()
        await busy
