"""A timeout Ray raises itself inside a GCS call on an activation's path (its own
``GetTimeoutError``, or a plain ``TimeoutError`` from below it) fails the activation
with ``ClusterUnavailable``, as our own deadline does: typed, retryable, answered 503
with Retry-After, with Ray's error kept as its cause. No Ray is started: the actor class
and the listing of named actors are replaced, at the module boundary, by fakes that
raise where the GCS call would.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import pytest
import ray
from ray.exceptions import GetTimeoutError

from actors import pool_hosts, ray_activator
from actors.admission import Admission
from tests.unit.test_named_creation import Actor, Channel, SlowClass, an_activator
from torpor.errors import ClusterUnavailable
from torpor.ports import Reason
from torpor.problems import problem_for


def ray_timeouts() -> list[TimeoutError]:
    return [
        GetTimeoutError("There was timeout in getting the actor handle"),
        TimeoutError("timed out reading from the GCS socket"),
    ]


def assert_typed_retryable(raised: pytest.ExceptionInfo[ClusterUnavailable], own: Any) -> None:
    assert raised.value.retryable
    assert raised.value.__cause__ is own, "Ray's own error is not kept as the cause"
    answer = problem_for(raised.value)
    assert answer.status == 503 and answer.retry_after is not None


@pytest.mark.parametrize("own", ray_timeouts(), ids=type)
async def test_a_dedicated_activation_whose_actor_make_times_out_in_ray_is_retryable(
    own: TimeoutError, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked of the GCS once, not once per attempt: ``GetTimeoutError`` read as an actor
    dying was asked again up to ``MAX_ATTEMPTS`` times (seconds of backoff, each a GCS
    call that had timed out); a plain one escaped untyped."""

    def times_out() -> None:
        raise own

    actor_class = SlowClass(Actor(), until=times_out)
    monkeypatch.setattr(ray_activator, "SessionActor", actor_class)
    with pytest.raises(ClusterUnavailable) as raised:
        async with asyncio.timeout(5):
            await an_activator()._dedicated("s_1", Reason.SUBMIT, 0.0)
    assert_typed_retryable(raised, own)
    assert actor_class.calls == 1


@pytest.mark.parametrize("own", ray_timeouts(), ids=type)
async def test_an_admission_check_that_times_out_in_ray_is_retryable(
    own: TimeoutError, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the cap, a dedicated request counts the live session actors (one listing of
    named actors): Ray's own timeout there escaped ``request`` untyped."""
    listed: list[bool] = []

    def list_named_actors(all_namespaces: bool = False) -> list[dict[str, str]]:
        listed.append(all_namespaces)
        raise own

    monkeypatch.setattr(ray.util, "list_named_actors", list_named_actors)
    activator = an_activator()
    activator._placements = OrderedDict()
    activator.admission = Admission(0, alive=activator._live_sessions)  # at the cap
    with pytest.raises(ClusterUnavailable) as raised:
        await activator.request("s_1", reason=Reason.SUBMIT, agent="")  # dedicated
    assert_typed_retryable(raised, own)
    assert listed == [True]


@pytest.mark.parametrize("through_a_channel", [True, False], ids=["channel", "ray-call"])
@pytest.mark.parametrize("own", ray_timeouts(), ids=type)
async def test_a_pooled_request_whose_host_make_times_out_in_ray_is_retryable(
    own: TimeoutError, through_a_channel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def times_out() -> None:
        raise own

    actor_class = SlowClass(Actor(), until=times_out)
    monkeypatch.setattr(pool_hosts, "PoolHost", actor_class)
    activator = an_activator(Channel() if through_a_channel else None)
    with pytest.raises(ClusterUnavailable) as raised:
        async with asyncio.timeout(5):
            await activator.pool_hosts.request("s_1", Reason.EVENT, 0.0)
    assert_typed_retryable(raised, own)
    assert actor_class.calls == 1
