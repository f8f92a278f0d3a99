"""A pooled request sent as a Ray call has one deadline for all its attempts
(``POOLED_DEADLINE_S``): past it the request fails with ``ActivationUnavailable``
(typed, retryable: its timer brings it round) raised from why its last attempt failed,
and no attempt's wait (a host's lookup, its answer, the pause) outlasts it. Without it,
hosts that never answered were asked ``MAX_ATTEMPTS`` times, a lookup, an answer and a
pause each: some 20 minutes, holding a coalescer's slot or a sweep. A host's check (in
the background, when its channel stalls) has the same bound. No Ray is started: the
hosts are fakes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest

from actors import pool_hosts
from actors.activation_calls import MAX_ATTEMPTS
from actors.pool_hosts import PoolHosts
from tests.unit.test_pooled_request import Host, Unreachable, pooled_activator
from tests.unit.test_stalled_channel import SilentHost
from torpor.backoff import fixed
from torpor.errors import ActivationUnavailable
from torpor.ports import Reason

DEADLINE_S = 0.3


@pytest.fixture(autouse=True)
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_hosts, "POOLED_DEADLINE_S", DEADLINE_S)


async def given_up(activator: Any) -> tuple[ActivationUnavailable, float]:
    """The error the pooled request for ``s_1`` ends with, and how long it took to."""
    started = time.monotonic()
    with pytest.raises(ActivationUnavailable) as raised:
        async with asyncio.timeout(5):
            await activator.request("s_1", reason=Reason.EVENT)
    assert raised.value.retryable
    return raised.value, time.monotonic() - started


async def test_silent_hosts_are_asked_until_the_deadline_not_max_attempts_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each attempt's host (looked up afresh after the last was silent) is silent for its
    whole answer time: the request stops at its deadline, after a few attempts."""
    monkeypatch.setattr(pool_hosts, "ACTIVATE_TIMEOUT_S", 0.05)
    hosts = [Host(None) for _ in range(MAX_ATTEMPTS)]
    with fixed(0):  # no pauses: only the deadline ends it before MAX_ATTEMPTS
        error, took = await given_up(pooled_activator(hosts))
    asked = sum(host.activate.calls for host in hosts)
    assert asked <= DEADLINE_S / 0.05 + 1 < MAX_ATTEMPTS, (
        f"{asked} attempts: the request ran past its deadline"
    )
    assert isinstance(error.__cause__, TimeoutError), "why it failed is not in the log"
    assert took < DEADLINE_S + 1.0


async def test_an_attempt_waits_for_its_host_no_longer_than_the_deadline_leaves() -> None:
    """A host's answer is given ``ACTIVATE_TIMEOUT_S`` (20 s) of its own, but not past
    the request's deadline; cut short, the host is not shown silent and stays known (the
    retry gives it its whole time, with no GCS lookup first)."""
    silent = Host(None)
    activator = pooled_activator([silent])
    error, took = await given_up(activator)
    assert isinstance(error.__cause__, TimeoutError), "why it failed is not in the log"
    assert took < DEADLINE_S + 1.0, f"the host's answer was waited on {took:.2f} s"
    assert silent.activate.calls == 1
    assert activator.pool_hosts._hosts == {0: silent}, "a host the deadline cut short was dropped"


async def test_hosts_failing_at_once_are_retried_until_the_deadline() -> None:
    """Every attempt fails at once (the host unreachable): the retries back off, with
    their real pauses, and stop at the deadline, raised from the last failure."""
    hosts = [Host(None) for _ in range(MAX_ATTEMPTS)]
    for host in hosts:
        host.activate = Unreachable()  # type: ignore[assignment]
    error, took = await given_up(pooled_activator(hosts))
    raised = [exc for host in hosts for exc in host.activate.raised]  # type: ignore[attr-defined]
    assert 1 < len(raised) < MAX_ATTEMPTS
    assert error.__cause__ is raised[-1], "why it failed is not in the log"
    assert took < DEADLINE_S + 1.0


async def test_a_host_make_that_outlasts_the_deadline_is_left_to_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request stops waiting for a host's get-or-create at its deadline; the make,
    shared with the other requests for the host, goes on and is kept when it ends."""
    made = asyncio.Event()
    host = Host("accepted")

    async def create_named(*_: object, **__: object) -> Host:
        await made.wait()  # a GCS slow to register the name
        return host

    monkeypatch.setattr(pool_hosts, "create_named", create_named)
    activator = pooled_activator([])
    del activator.pool_hosts._host  # the real cache: made by ``create_named``
    error, took = await given_up(activator)
    assert isinstance(error.__cause__, TimeoutError), "why it failed is not in the log"
    assert took < DEADLINE_S + 1.0, f"the host's make was waited on {took:.2f} s"
    making = activator.pool_hosts._making_hosts[0]
    assert not making.done(), "the make others share was cancelled"
    made.set()
    async with asyncio.timeout(5):
        await making
    assert activator.pool_hosts._hosts == {0: host}


class Listening:
    """A host's ``listen``, silent (never answered): a node gone, not yet declared dead."""

    def __init__(self) -> None:
        self.calls = 0

    def remote(self) -> asyncio.Future[bool]:
        self.calls += 1
        return asyncio.get_running_loop().create_future()


def checked_hosts(looked_up: Any) -> PoolHosts:
    hosts = PoolHosts(object(), namespace="t", size=1, services=SimpleNamespace(activations=None))

    async def host(slot: int) -> Any:
        if slot not in hosts._hosts:
            hosts._hosts[slot] = next(looked_up)
        return hosts._hosts[slot]

    hosts._host = host  # type: ignore[method-assign]
    return hosts


async def test_a_host_check_asks_silent_hosts_until_the_deadline_not_max_attempts_times(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The check behind a stalled channel gives up at the deadline too (logged, with
    why): run on for ``MAX_ATTEMPTS`` lookups and answers, it shut every later check of
    the slot out for some 20 minutes."""
    monkeypatch.setattr(pool_hosts, "ACTIVATE_TIMEOUT_S", 0.05)
    silent = [SilentHost() for _ in range(MAX_ATTEMPTS)]
    hosts = checked_hosts(iter(silent))
    started = time.monotonic()
    with fixed(0), caplog.at_level(logging.ERROR, logger=pool_hosts.__name__):
        async with asyncio.timeout(5):
            await hosts._check_host(0)
    asked = sum(host.asked for host in silent)
    assert asked <= DEADLINE_S / 0.05 + 1 < MAX_ATTEMPTS, (
        f"{asked} attempts: the check ran past its deadline"
    )
    assert time.monotonic() - started < DEADLINE_S + 1.0
    [given_up] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert given_up.exc_info is not None and isinstance(given_up.exc_info[1], TimeoutError)


async def test_a_host_check_waits_no_longer_than_the_deadline_and_keeps_the_host() -> None:
    """``listen`` is given ``ACTIVATE_TIMEOUT_S`` (20 s) of its own, not past the check's
    deadline; cut short, the host is not shown silent and stays known."""
    silent = SimpleNamespace(listen=Listening())
    hosts = checked_hosts(itertools.repeat(silent))
    started = time.monotonic()
    async with asyncio.timeout(5):
        await hosts._check_host(0)
    assert time.monotonic() - started < DEADLINE_S + 1.0
    assert silent.listen.calls == 1
    assert hosts._hosts == {0: silent}, "a host the deadline cut short was dropped"
