"""A request that finds its pool host's channel stalled is answered at once; the host
is checked behind it (pure code, no Ray started: the queue and the host are fakes)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from actors import pool_hosts
from actors.pool_hosts import PoolHosts
from actors.ray_activator import RayActivator
from torpor.backoff import fixed
from torpor.ports import Reason
from torpor.ports.activation import Wanted
from torpor.settings import Settings


class StalledChannel:
    """A channel nobody takes from: every push finds the line long."""

    def __init__(self) -> None:
        self.pushed: list[Wanted] = []

    async def push(self, channel: str, wanted: Wanted) -> int:
        self.pushed.append(wanted)
        return pool_hosts.STALLED_CHANNEL + len(self.pushed)


class SilentHost:
    """A host that never answers ``listen`` (a node gone, not yet declared dead)."""

    def __init__(self) -> None:
        self.asked = 0
        self.listen = SimpleNamespace(remote=self._listen)

    def _listen(self) -> asyncio.Future[bool]:
        self.asked += 1
        return asyncio.get_running_loop().create_future()  # never answered


def pooled_activator(queue: StalledChannel, host: SilentHost) -> Any:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: the host is a fake
    activator._watchers = set()
    activator._predecessor = None
    activator.standby = None
    activator.pool_hosts = PoolHosts(
        object(),  # handed to no actor: the hosts are fakes
        namespace="t",
        size=Settings().pool.size,
        services=SimpleNamespace(activations=queue),
    )

    async def known(slot: int) -> SilentHost:
        return host

    activator.pool_hosts._host = known
    return activator


async def test_a_request_to_a_stalled_channel_is_not_held_for_the_hosts_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check asks a host that does not answer for up to 40 x 20 s. Awaited on the
    request's path, a webhook whose push found the line long waited for all of it
    before its 202 (and an in-process sender's whole batch behind it)."""
    monkeypatch.setattr(pool_hosts, "ACTIVATE_TIMEOUT_S", 30.0)
    queue, host = StalledChannel(), SilentHost()
    activator = pooled_activator(queue, host)
    async with asyncio.timeout(5):
        await activator.pool_hosts.request("s_1", Reason.EVENT, 0.0)
        await activator.pool_hosts.request("s_2", Reason.EVENT, 0.0)
    assert len(queue.pushed) == 2
    async with asyncio.timeout(5):  # the check starts behind the requests
        while host.asked == 0:
            await asyncio.sleep(0.01)
    assert host.asked == 1, "one check at a time, not one per request"
    assert len(activator.pool_hosts._host_checks) == 1
    await activator.close()
    assert activator.pool_hosts._host_checks == {}


class Listening:
    """A host whose ``listen`` calls the test answers (or fails) one by one."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[bool]] = []
        self.listen = SimpleNamespace(remote=self._listen)

    def _listen(self) -> asyncio.Future[bool]:
        self.calls.append(asyncio.get_running_loop().create_future())
        return self.calls[-1]


async def test_a_host_check_drops_only_the_handle_that_failed_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A check whose host failed under it dropped whatever the slot held, even a fresh
    handle a request had found meanwhile: the check then made or looked the host up
    again, a GCS call for a host already known."""
    made: list[Listening] = []

    async def create_named(*_: object, **__: object) -> Listening:
        made.append(Listening())
        return made[-1]

    monkeypatch.setattr(pool_hosts, "create_named", create_named)
    old, fresh = Listening(), Listening()
    hosts = PoolHosts(
        object(),  # handed to no actor: the hosts are fakes
        namespace="t",
        size=1,
        services=SimpleNamespace(activations=None),
    )
    hosts._hosts[0] = old
    async with asyncio.timeout(5):
        check = asyncio.create_task(hosts._check_host(0))
        while not old.calls:
            await asyncio.sleep(0)
        hosts._hosts[0] = fresh  # a request found the host's successor meanwhile
        old.calls[0].set_exception(ActorUnavailableError("restarting", None))
        while not fresh.calls:  # the check's next attempt asks the cached one
            await asyncio.sleep(0)
        fresh.calls[0].set_result(True)
        await check
    assert made == [], "the fresh handle was kept: nothing made or looked up again"
    assert hosts._hosts[0] is fresh


class Unreachable:
    """A host whose every ``listen`` call fails as Ray finds its node unreachable."""

    def __init__(self, raised: list[ActorUnavailableError]) -> None:
        self.raised = raised
        self.listen = SimpleNamespace(remote=self._listen)

    def _listen(self) -> asyncio.Future[bool]:
        self.raised.append(ActorUnavailableError("the host's node is unreachable", None))
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        future.set_exception(self.raised[-1])
        return future


async def test_a_host_check_given_up_logs_why_the_last_attempt_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its requests then wait for their timers: the log said no host answered, never
    why (unreachable, dead, silent, or a GCS that did not find it)."""
    monkeypatch.setattr(pool_hosts, "MAX_ATTEMPTS", 2)
    raised: list[ActorUnavailableError] = []

    async def create_named(*_: object, **__: object) -> Unreachable:
        return Unreachable(raised)

    monkeypatch.setattr(pool_hosts, "create_named", create_named)
    hosts = PoolHosts(object(), namespace="t", size=1, services=SimpleNamespace(activations=None))
    with fixed(0), caplog.at_level(logging.ERROR, logger=pool_hosts.__name__):
        async with asyncio.timeout(5):
            await hosts._check_host(0)
    assert len(raised) == 2
    [given_up] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert given_up.exc_info is not None and given_up.exc_info[1] is raised[-1]
