"""Looking named actors up never stalls the event loop, and has a deadline (no Ray
started: Ray's two GCS calls are replaced, at the module boundary, by slow ones).

``ray.get_actor`` and ``ray.util.list_named_actors`` block their calling thread until
the GCS answers (Ray's own deadline: 60 s). Made on the loop of a Serve replica, a pool
host or the reconciler, a slow GCS stalled every other coroutine of the process: each
test runs one operation that looks actors up while another coroutine ticks on the same
loop, and measures the longest the ticks were held up.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError

from actors import named, work_watcher
from actors.config_ref import ConfigRef
from actors.ray_activator import Admission, RayActivator
from actors.ray_work import Kind, Launch, WorkContext, WorkWatcher
from actors.standby import left_by, standby_prefix
from tests.unit.test_ray_work_runner import Reports, Tasks, a_runner, an_order
from torpor.errors import ClusterUnavailable, WorkStopFailed
from torpor.work import WorkState

SLOW_S = 1.0  # one GCS call under load
TICK_S = 0.01


class SlowGcs:
    """Ray's two GCS calls, each taking ``SLOW_S`` in the thread that makes it. The
    listing names ``names`` (in namespace ``t``); no actor is found by its name."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = names
        self.calls = 0

    def get_actor(self, name: str, namespace: str | None = None) -> Any:
        self.calls += 1
        time.sleep(SLOW_S)
        raise ValueError(f"Failed to look up actor with name {name!r}")

    def list_named_actors(self, all_namespaces: bool = False) -> list[dict[str, str]]:
        self.calls += 1
        time.sleep(SLOW_S)
        return [{"name": name, "namespace": "t"} for name in self.names]


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> SlowGcs:
    slow = SlowGcs(names=(standby_prefix("holder") + "a",))
    monkeypatch.setattr(ray, "get_actor", slow.get_actor)
    monkeypatch.setattr(ray.util, "list_named_actors", slow.list_named_actors)
    return slow


async def longest_stall(operation: Callable[[], Awaitable[Any]]) -> float:
    """The longest another coroutine on this loop waited for its turn while
    ``operation`` ran (its own errors are not this measure's business)."""
    ticks: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            ticks.append(time.monotonic())
            await asyncio.sleep(TICK_S)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # its first tick is in
    try:
        async with asyncio.timeout(30):
            with contextlib.suppress(Exception):
                await operation()
    finally:
        done = True
        await ticker
    ticks.append(time.monotonic())
    return max(later - earlier for earlier, later in itertools.pairwise(ticks))


async def work_status() -> Any:
    order = an_order()
    runner = await a_runner(Launch(Kind.ACTOR, actor="model", method="embed"), order)
    return await runner.status(order.work_id)  # looks its watcher up


async def work_stop() -> None:
    order = an_order()
    runner = await a_runner(Launch(Kind.TASK, fn=lambda args, ctx: None), order)
    await runner.stop(order.work_id, reason="cancelled")  # looks its watcher up


async def actor_call_started() -> None:
    order = an_order()
    launch = Launch(Kind.ACTOR, actor="model", method="embed")
    runner = await a_runner(launch, order)
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )
    await watcher._execute(runner.records, 1)  # looks the actor up to call it


async def actor_known_dead() -> None:
    await work_watcher._actor_dead(Launch(Kind.ACTOR, actor="model", method="embed"))


async def admission_checked() -> None:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: only the admission path
    activator.namespace, activator._adopted = "t", {}
    admission = Admission(0, alive=activator._live_sessions)
    await admission.admit("s_1")  # at the cap: the live session actors are listed


async def standbys_left() -> None:
    await left_by("holder", "t")  # a listing, then a lookup of the one it names


@pytest.mark.parametrize(
    "operation",
    [
        work_status,
        work_stop,
        actor_call_started,
        actor_known_dead,
        admission_checked,
        standbys_left,
    ],
)
async def test_a_slow_gcs_does_not_stall_the_event_loop(
    operation: Callable[[], Awaitable[Any]], gcs: SlowGcs
) -> None:
    stall = await longest_stall(operation)
    assert gcs.calls >= 1, "the operation asked the GCS nothing: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s GCS call"


@pytest.fixture
def silent_gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A GCS that answers no lookup until the test ends (then: no such actor)."""
    answer = threading.Event()

    def get_actor(name: str, namespace: str | None = None) -> Any:
        answer.wait(30)
        raise ValueError(f"Failed to look up actor with name {name!r}")

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    yield answer
    answer.set()  # the threads given up on end now


async def test_a_lookup_the_gcs_does_not_answer_fails_at_its_deadline_and_may_be_retried(
    silent_gcs: threading.Event,
) -> None:
    started = time.monotonic()
    with pytest.raises(ClusterUnavailable) as raised:
        await named.get_actor("work:w1", "t")
    assert time.monotonic() - started < 5
    assert raised.value.retryable
    # A ``TimeoutError``, as Ray's own ``GetTimeoutError``: what callers read as
    # "not known gone", never as "no such actor".
    assert isinstance(raised.value, TimeoutError)


async def test_a_stop_whose_watcher_lookup_times_out_is_asked_again(
    silent_gcs: threading.Event,
) -> None:
    """Read as "no watcher", a task's stop would be reported done while it ran on."""
    order = an_order()
    runner = await a_runner(Launch(Kind.TASK, fn=lambda args, ctx: None), order)
    async with asyncio.timeout(5):
        with pytest.raises(WorkStopFailed) as raised:
            await runner.stop(order.work_id, reason="cancelled")
    assert raised.value.retryable


async def test_a_status_whose_watcher_lookup_times_out_is_not_a_lost_run(
    silent_gcs: threading.Event,
) -> None:
    order = an_order()
    runner = await a_runner(Launch(Kind.ACTOR, actor="model", method="embed"), order)
    async with asyncio.timeout(5):
        status = await runner.status(order.work_id)
    assert status.state is WorkState.RUNNING, status


def test_rays_own_deadline_reached_first_is_raised_as_ray_raised_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gcs_timeout(name: str, namespace: str | None = None) -> Any:
        raise GetTimeoutError("There was timeout in getting the actor handle")

    monkeypatch.setattr(ray, "get_actor", gcs_timeout)
    with pytest.raises(GetTimeoutError):
        asyncio.run(named.get_actor("work:w1", "t"))


async def test_a_timeout_raised_by_the_call_itself_is_raised_as_itself() -> None:
    """A ``TimeoutError`` of the call's own (a socket's inside Ray, say) is its error, not
    our deadline: relabelled ``ClusterUnavailable``, it read as "the GCS did not answer
    within 10 s" after a few milliseconds, and its own message was lost."""
    own = TimeoutError("timed out reading from the GCS socket")

    def call() -> Any:
        raise own

    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        await named.gcs_call(call, "looking up actor 'work:w1'", timeout_s=5)
    assert raised.value is own, f"relabelled: {type(raised.value).__name__}: {raised.value}"
    assert time.monotonic() - started < 1


async def test_our_deadline_passing_is_cluster_unavailable_and_says_so() -> None:
    release = threading.Event()
    try:
        with pytest.raises(ClusterUnavailable) as raised:
            await named.gcs_call(lambda: release.wait(30), "looking up actor 'w'", timeout_s=0.2)
    finally:
        release.set()  # the thread given up on ends now
    assert str(raised.value) == "looking up actor 'w': the GCS did not answer within 0.2 s"
    assert raised.value.retryable


async def test_a_work_reports_progress_to_its_watcher_without_asking_the_gcs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher hands the work its own handle: a report looked the watcher up by name
    in the work function, and a slow GCS held it there (an async actor's whole loop,
    when the work is an actor's method) for up to Ray's 60 s."""
    own = Reports()
    context = type("Context", (), {"current_actor": own})()
    cls = WorkWatcher.__ray_metadata__.modified_class  # type: ignore[attr-defined]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as in the watcher's actor
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    gcs = SlowGcs()
    monkeypatch.setattr(ray, "get_actor", gcs.get_actor)
    handed: list[WorkContext] = []

    class Recorded(Tasks):
        def remote(self, *args: Any) -> asyncio.Future[Any]:
            handed.append(args[2])  # (fn, request, ctx)
            return super().remote(*args)

    monkeypatch.setattr(ray, "remote", Recorded(RuntimeError("not run here")))
    order = an_order()
    launch = Launch(Kind.TASK, fn=lambda args, ctx: None)
    runner = await a_runner(launch, order)
    watcher = cls(ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch)
    with contextlib.suppress(Exception):
        await watcher._execute(runner.records, 1)
    [ctx] = handed
    started = time.monotonic()
    ctx.progress(0.5, "half")
    assert time.monotonic() - started < SLOW_S / 2 and gcs.calls == 0
    assert own.sent == [(0.5, "half")]


async def test_a_work_stopped_while_its_actor_is_looked_up_calls_no_method(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watcher checks its stop before it starts the run, then looks the work's actor
    up (off the loop now, so its ``stop`` may run meanwhile). That stop finds nothing
    started to cancel and reports the work stopped: the method called after the lookup
    ran its side effects unseen, its outcome dropped."""
    called: list[object] = []
    looked_up = threading.Event()
    release = threading.Event()

    def get_actor(name: str, namespace: str | None = None) -> Any:
        looked_up.set()
        release.wait(10)
        return type("Model", (), {"embed": type("M", (), {"remote": staticmethod(called.append)})})

    monkeypatch.setattr(ray, "get_actor", get_actor)
    order = an_order()
    launch = Launch(Kind.ACTOR, actor="model", method="embed")
    runner = await a_runner(launch, order)
    watcher = WorkWatcher.__ray_metadata__.modified_class(  # type: ignore[attr-defined]
        ConfigRef.of_loaded(runner.settings), dict(order.as_data()), launch
    )
    run = asyncio.create_task(watcher._execute(runner.records, 1))
    async with asyncio.timeout(10):
        while not looked_up.is_set():
            await asyncio.sleep(0.01)
        await watcher.stop()  # during the lookup: nothing started yet to cancel
        release.set()
        assert await run is None
    assert called == [], "the actor's method was called after the work was stopped"
