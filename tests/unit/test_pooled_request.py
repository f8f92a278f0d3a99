"""A pooled activation request sent as a Ray call (no Redis channel): every call has a
deadline (pure code, no Ray started: the hosts are fakes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from actors import ray_activator
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
    activator.services = SimpleNamespace(activations=None)  # no channel: Ray calls
    activator.settings = SimpleNamespace(pool=SimpleNamespace(size=1))
    activator.namespace = "t"
    activator._placements = {"s_1": Placement.POOLED}
    activator._hosts = {}
    looked_up = iter(hosts)

    async def host(slot: int) -> Host:
        if slot not in activator._hosts:
            activator._hosts[slot] = next(looked_up)
        return activator._hosts[slot]

    activator._host = host
    return activator


async def test_a_silent_pool_host_is_given_up_on_and_looked_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 0.05)
    silent, live = Host(None), Host("accepted")
    activator = pooled_activator([silent, live])
    with fixed(0):
        async with asyncio.timeout(5):  # the request waited on the silent host for ever
            await activator.request("s_1", reason=Reason.EVENT)
    assert silent.activate.calls == 1 and live.activate.calls == 1


async def test_a_pool_host_that_never_answers_fails_the_request_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_activator, "ACTIVATE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_activator, "MAX_ATTEMPTS", 3)
    hosts = [Host(None) for _ in range(3)]
    activator = pooled_activator(hosts)
    with fixed(0), pytest.raises(ActivationUnavailable):
        async with asyncio.timeout(5):
            await activator.request("s_1", reason=Reason.EVENT)
    assert [h.activate.calls for h in hosts] == [1, 1, 1]
