"""Making a named actor never stalls the event loop, and has a deadline (no Ray started:
the actor classes are replaced, at the module boundary, by ones whose ``.remote()``
blocks its thread as the GCS would).

``.options(name=..., get_if_exists=True).remote(...)`` looks the name up first
(``ray.get_actor``), and Ray registers a new actor's name with the GCS before
``.remote()`` returns: both block the calling thread until the GCS answers (Ray's own
deadline: 60 s). Made on the loop of a Serve replica or a pool host, a slow GCS stalled
every other coroutine of the process. Each test runs one operation that makes an actor
while another coroutine ticks on the same loop (``longest_stall``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from actors import named, pool_hosts, ray_activator, ray_work
from actors.pool_hosts import PoolHosts
from actors.ray_activator import RayActivator
from actors.ray_work import Kind, Launch
from actors.session_actor import ACCEPTED
from actors.standby import StandbySet
from tests.unit.test_named_lookups import SLOW_S, longest_stall
from tests.unit.test_ray_work_runner import a_runner, an_order
from torpor.errors import ClusterUnavailable
from torpor.ports import Reason
from torpor.ports.activation import Wanted
from torpor.settings import Settings


class Method:
    """An actor method that answers ``answer`` at once."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls = 0

    def remote(self, *args: object) -> asyncio.Future[Any]:
        self.calls += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_result(self.answer)
        return future


class Actor:
    """A session actor (named or standby), a pool host or a work's watcher: every call
    answers at once."""

    def __init__(self) -> None:
        self.ready = Method(1234)
        self.activate = Method(ACCEPTED)
        self.retire = Method(True)
        self.listen = Method(True)
        self.where = Method("node")
        self.start = Method(ACCEPTED)


class SlowClass:
    """An actor class whose ``.options(...).remote(...)`` blocks the thread that calls it
    for ``SLOW_S`` (the GCS's lookup of the name, then its registration), then hands
    back ``made``."""

    def __init__(self, made: Any, *, until: Callable[[], object] | None = None) -> None:
        self.made = made
        self.until = until or (lambda: time.sleep(SLOW_S))
        self.calls = 0
        self.options_asked: list[dict[str, Any]] = []

    def options(self, **options: Any) -> SlowClass:
        self.options_asked.append(options)
        return self

    def remote(self, *args: Any) -> Any:
        self.calls += 1
        self.until()
        return self.made


class Channel:
    """A pool host's activation channel, taken from at once."""

    def __init__(self) -> None:
        self.pushed: list[Wanted] = []

    async def push(self, channel: str, wanted: Wanted) -> int:
        self.pushed.append(wanted)
        return 1


def an_activator(channel: Channel | None = None) -> Any:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: the actors are fakes
    activator.namespace, activator.config, activator.settings = "t", object(), Settings()
    activator.services = SimpleNamespace(activations=channel)
    activator.standby, activator._holder, activator._predecessor = None, None, None
    activator._adopted, activator._adopting, activator._watchers = {}, {}, set()
    activator.pool_hosts = PoolHosts(
        activator.config,
        namespace="t",
        size=activator.settings.pool.size,
        services=activator.services,
    )
    return activator


async def dedicated_activation() -> None:
    await an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0)


async def standby_started() -> None:
    standby = StandbySet(1, an_activator()._spawn_standby)
    try:
        await standby.filled(timeout_s=5)
    finally:
        await standby.close()


async def pooled_through_its_channel() -> None:
    await an_activator(Channel()).pool_hosts.request("s_1", Reason.EVENT, 0.0)


async def pooled_as_a_ray_call() -> None:
    await an_activator().pool_hosts.request("s_1", Reason.EVENT, 0.0)


async def pool_host_checked() -> None:
    await an_activator().pool_hosts._check_host(0)


async def pool_warmed() -> None:
    await an_activator().warm()


async def work_started() -> None:
    order = an_order()
    runner = await a_runner(Launch(Kind.TASK, fn=lambda args, ctx: None), order)
    await runner.start(order)  # its watcher, got or made by name


@pytest.mark.parametrize(
    "operation",
    [
        dedicated_activation,
        standby_started,
        pooled_through_its_channel,
        pooled_as_a_ray_call,
        pool_host_checked,
        pool_warmed,
        work_started,
    ],
)
async def test_a_slow_gcs_does_not_stall_the_event_loop_while_an_actor_is_made(
    operation: Callable[[], Awaitable[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    actor_class = SlowClass(Actor())
    monkeypatch.setattr(ray_activator, "SessionActor", actor_class)
    monkeypatch.setattr(pool_hosts, "PoolHost", actor_class)
    monkeypatch.setattr(ray_work, "WorkWatcher", actor_class)
    stall = await longest_stall(operation)
    assert actor_class.calls >= 1, "the operation made no actor: this measured nothing"
    assert stall < SLOW_S / 2, f"the loop was held {stall:.2f} s by a {SLOW_S} s GCS call"


@pytest.fixture
def silent_gcs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowClass]:
    """A GCS that makes no actor until the test ends (then it makes one)."""
    answer = threading.Event()
    actor_class = SlowClass(Actor(), until=lambda: answer.wait(10))
    monkeypatch.setattr(ray_activator, "SessionActor", actor_class)
    monkeypatch.setattr(ray_work, "WorkWatcher", actor_class)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    yield actor_class
    answer.set()  # the threads given up on end now


async def test_an_activation_whose_actor_the_gcs_does_not_make_fails_at_its_deadline(
    silent_gcs: SlowClass,
) -> None:
    """Asked once, not once per attempt (up to 40 x the deadline): the request fails,
    retryable, and its timer brings it round."""
    started = time.monotonic()
    with pytest.raises(ClusterUnavailable) as raised:
        await dedicated_activation()
    assert time.monotonic() - started < 5
    assert raised.value.retryable
    assert silent_gcs.calls == 1
    assert silent_gcs.options_asked[0]["get_if_exists"] is True


async def test_a_work_whose_watcher_the_gcs_does_not_make_fails_its_dispatch_at_its_deadline(
    silent_gcs: SlowClass,
) -> None:
    """Retryable: the outbox sends it again later, and finds the watcher by its name if
    the GCS made it meanwhile."""
    started = time.monotonic()
    with pytest.raises(ClusterUnavailable) as raised:
        await work_started()
    assert time.monotonic() - started < 5
    assert raised.value.retryable
    assert silent_gcs.calls == 1


async def test_a_standby_made_after_its_start_was_given_up_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A standby's name is random: one the GCS made after its start had been given up
    was known to nobody, and with ``standby_idle_s = 0`` it waited for a session for
    ever (a process)."""
    made = Actor()
    actor_class = SlowClass(made)  # SLOW_S, past the deadline below
    monkeypatch.setattr(ray_activator, "SessionActor", actor_class)
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.2)
    killed: list[Any] = []
    monkeypatch.setattr(
        ray_activator.ray, "kill", lambda handle, no_restart=True: killed.append(handle)
    )
    standby = StandbySet(1, an_activator()._spawn_standby)
    standby.refill()
    try:
        async with asyncio.timeout(5):
            while not killed:
                await asyncio.sleep(0.01)
    finally:
        await standby.close()
    assert killed == [made]
    assert standby.ready == 0


async def test_an_actor_made_after_its_caller_was_cancelled_is_handed_over() -> None:
    """Cancelled (not timed out) while its thread made the actor: the handle goes to
    ``abandoned``, in the thread that made it."""
    made = object()
    handed: list[Any] = []
    started, cancelled = threading.Event(), threading.Event()

    def slowly() -> None:
        started.set()
        cancelled.wait(10)  # the actor is made only once its caller has given up

    making = asyncio.create_task(
        named.create_named(
            SlowClass(made, until=slowly), name="x", namespace="t", abandoned=handed.append
        )
    )
    async with asyncio.timeout(5):
        while not started.is_set():
            await asyncio.sleep(0.01)
    making.cancel()
    cancelled.set()
    with pytest.raises(asyncio.CancelledError):
        await making
    async with asyncio.timeout(5):
        while not handed:
            await asyncio.sleep(0.01)
    assert handed == [made]


async def test_a_known_pool_host_costs_a_request_no_gcs_call_and_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every pooled request (a webhook's resume) passes through its host's handle: once
    known, it is handed back without a GCS call, and without leaving the loop."""
    actor_class = SlowClass(Actor())
    monkeypatch.setattr(pool_hosts, "PoolHost", actor_class)
    channel = Channel()
    activator = an_activator(channel)
    slot = pool_hosts.pool_slot("s_1", activator.settings.pool.size)
    for _ in range(3):
        await activator.pool_hosts.request("s_1", Reason.EVENT, 0.0)
    assert actor_class.calls == 1 and len(channel.pushed) == 3
    known = activator.pool_hosts._host(slot)
    with pytest.raises(StopIteration):  # done at its first step: it never suspended
        known.send(None)


async def test_requests_that_find_no_pool_host_yet_share_one_get_or_create(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst at a cold replica: one get-or-create for the slot, not one per request."""
    actor_class = SlowClass(Actor())
    monkeypatch.setattr(pool_hosts, "PoolHost", actor_class)
    channel = Channel()
    activator = an_activator(channel)
    async with asyncio.timeout(5):
        await asyncio.gather(
            *(activator.pool_hosts.request("s_1", Reason.EVENT, 0.0) for _ in range(5))
        )
    assert actor_class.calls == 1 and len(channel.pushed) == 5
    assert activator.pool_hosts._making_hosts == {}
