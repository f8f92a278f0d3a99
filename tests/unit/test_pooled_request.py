"""A pooled activation request sent as a Ray call (no Redis channel): every call has a
deadline (pure code, no Ray started: the hosts are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from actors import pool_hosts
from actors.pool_hosts import PoolHosts
from actors.ray_activator import RayActivator
from torpor.backoff import fixed
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason
from torpor.settings import Placement


class Method:
    def __init__(self, answer: Any) -> None:
        self._answer = answer
        self.calls = 0

    def remote(self, *_: object) -> asyncio.Future[Any]:
        self.calls += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self._answer is not None:
            future.set_result(self._answer)
        return future  # no answer: a host on a node gone but not yet declared dead


class Host:
    def __init__(self, answer: Any) -> None:
        self.activate = Method(answer)


def pooled_activator(hosts: list[Host]) -> Any:
    activator: Any = RayActivator.__new__(RayActivator)  # no Ray: only the pooled path
    activator._placements = {"s_1": Placement.POOLED}
    # No channel: Ray calls. ``object()``: a config handed to no actor (hosts are fakes).
    activator.pool_hosts = pooled = PoolHosts(
        object(), namespace="t", size=1, services=SimpleNamespace(activations=None)
    )
    looked_up = iter(hosts)

    async def host(slot: int) -> Host:
        if slot not in pooled._hosts:
            pooled._hosts[slot] = next(looked_up)
        return pooled._hosts[slot]

    pooled._host = host
    return activator


async def test_a_silent_pool_host_is_given_up_on_and_looked_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_hosts, "ACTIVATE_TIMEOUT_S", 0.05)
    silent, live = Host(None), Host("accepted")
    activator = pooled_activator([silent, live])
    with fixed(0):
        async with asyncio.timeout(5):  # the request waited on the silent host for ever
            await activator.request("s_1", reason=Reason.EVENT)
    assert silent.activate.calls == 1 and live.activate.calls == 1


async def test_a_pool_host_that_never_answers_fails_the_request_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_hosts, "ACTIVATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(pool_hosts, "MAX_ATTEMPTS", 3)
    hosts = [Host(None) for _ in range(3)]
    activator = pooled_activator(hosts)
    with fixed(0), pytest.raises(ActivationUnavailable):
        async with asyncio.timeout(5):
            await activator.request("s_1", reason=Reason.EVENT)
    assert [h.activate.calls for h in hosts] == [1, 1, 1]


class Unreachable:
    """A host's ``activate`` whose call fails as Ray finds the host unreachable."""

    def __init__(self) -> None:
        self.raised: list[ActorUnavailableError] = []

    def remote(self, *_: object) -> asyncio.Future[Any]:
        self.raised.append(ActorUnavailableError("the host's node is unreachable", None))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.set_exception(self.raised[-1])
        return future


async def test_a_request_no_pool_host_took_is_raised_from_why_the_last_did_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Raised without a cause, the log said no host took it, never why."""
    monkeypatch.setattr(pool_hosts, "MAX_ATTEMPTS", 3)
    hosts = [Host(None) for _ in range(3)]
    for host in hosts:
        host.activate = Unreachable()  # type: ignore[assignment]
    activator = pooled_activator(hosts)
    with fixed(0), pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await activator.request("s_1", reason=Reason.EVENT)
    last = hosts[-1].activate.raised  # type: ignore[attr-defined]
    assert len(last) == 1
    assert raised.value.__cause__ is last[0], "why it failed is not in the log"


class FailingOnce:
    """A host's ``activate``: each call answers only when the test fails or answers it."""

    def __init__(self) -> None:
        self.calls: list[asyncio.Future[Any]] = []

    def remote(self, *_: object) -> asyncio.Future[Any]:
        self.calls.append(asyncio.get_running_loop().create_future())
        return self.calls[-1]


async def test_a_host_found_afresh_is_not_dropped_by_a_later_failure_of_the_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests sent to one host that then died: the first to see it fail found its
    successor and cached it; the second, failing on the old handle after that, dropped
    whatever the slot held (the fresh one), and made or looked the host up again: a
    second GCS call for a host already known. Only the handle that failed is dropped."""
    old = SimpleNamespace(activate=FailingOnce())
    made: list[Host] = []

    async def create_named(*_: object, **__: object) -> Host:
        made.append(Host("accepted"))
        return made[-1]

    monkeypatch.setattr(pool_hosts, "create_named", create_named)
    activator = pooled_activator([])
    del activator.pool_hosts._host  # the real cache: looked up or made by ``create_named``
    activator.pool_hosts._hosts[0] = old
    activator._placements["s_2"] = Placement.POOLED
    with fixed(0):
        async with asyncio.timeout(5):
            first = asyncio.create_task(activator.request("s_1", reason=Reason.EVENT))
            second = asyncio.create_task(activator.request("s_2", reason=Reason.EVENT))
            while len(old.activate.calls) < 2:  # both sent to the old host
                await asyncio.sleep(0)
            old.activate.calls[0].set_exception(ActorUnavailableError("restarting", None))
            await first  # it found a fresh host, which took the request
            assert len(made) == 1 and activator.pool_hosts._hosts[0] is made[0]
            old.activate.calls[1].set_exception(ActorUnavailableError("restarting", None))
            await second
    assert len(made) == 1, "the fresh host was kept: no second make"
    assert made[0].activate.calls == 2
