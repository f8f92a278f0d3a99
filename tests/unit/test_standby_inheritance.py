"""Finding the standbys a restarted holder's predecessor left (``left_by``):
the lookups run at once, under one deadline, and one that does not answer is left out,
not the whole search failed (no Ray started: Ray's two GCS calls are replaced, at the
module boundary, by fakes that answer from the lookup threads)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from actors import named
from actors.standby_inheritance import left_by, standby_prefix

PREFIX = standby_prefix("holder")


class Gcs:
    """Ray's listing names ``names`` (in namespace ``t``); ``ray.get_actor`` answers a
    handle (the name itself) after ``before_answer(name)`` returns."""

    def __init__(self, names: list[str], before_answer: Callable[[str], None]) -> None:
        self.names = names
        self.before_answer = before_answer

    def get_actor(self, name: str, namespace: str | None = None) -> Any:
        self.before_answer(name)
        return f"handle:{name}"

    def list_named_actors(self, all_namespaces: bool = False) -> list[dict[str, str]]:
        return [{"name": name, "namespace": "t"} for name in self.names]


@pytest.fixture
def released() -> Iterator[threading.Event]:
    """Set at the end of the test: a lookup thread held on it ends then."""
    event = threading.Event()
    yield event
    event.set()


def use(monkeypatch: pytest.MonkeyPatch, gcs: Gcs) -> None:
    monkeypatch.setattr(ray, "get_actor", gcs.get_actor)
    monkeypatch.setattr(ray.util, "list_named_actors", gcs.list_named_actors)


async def test_the_left_standbys_are_looked_up_at_once_not_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each lookup answers only once all three are under way: one after another, the
    first waited for the other two for ever (N x 10 s on a slow GCS, before the holder's
    first refill)."""
    names = [f"{PREFIX}{n}" for n in "abc"]
    all_in = threading.Barrier(len(names), timeout=5)  # broken when they run one by one
    use(monkeypatch, Gcs(names, lambda _: all_in.wait()))
    found = await left_by("holder", "t")
    assert found == [f"handle:{name}" for name in names]


async def test_a_lookup_that_does_not_answer_in_time_is_left_out_not_the_search_failed(
    monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    """One lookup with no answer past its deadline (``ClusterUnavailable``) failed the
    whole search: the standbys that *were* found were then neither inherited nor asked
    to go. It is unknown, left out (its standby is left to its idle time); the others
    are found."""
    names = [f"{PREFIX}a", f"{PREFIX}slow", f"{PREFIX}b"]

    def before_answer(name: str) -> None:
        if name.endswith("slow"):
            released.wait()  # the GCS does not answer this one

    use(monkeypatch, Gcs(names, before_answer))
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 0.3)  # each call's own deadline
    async with asyncio.timeout(10):  # the held thread is released only after the test
        found = await left_by("holder", "t")
    assert found == [f"handle:{PREFIX}a", f"handle:{PREFIX}b"]


async def test_a_lookup_that_times_out_in_ray_itself_is_left_out_not_the_search_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's own timeout inside a lookup (``GetTimeoutError``, raised as itself by
    ``named`` since it stopped relabelling it as our deadline) is unknown too: it failed
    the whole search, leaving the standbys that were found unkept."""
    names = [f"{PREFIX}a", f"{PREFIX}late", f"{PREFIX}b"]

    def before_answer(name: str) -> None:
        if name.endswith("late"):
            raise ray.exceptions.GetTimeoutError("the GCS timed out")

    use(monkeypatch, Gcs(names, before_answer))
    async with asyncio.timeout(10):
        found = await left_by("holder", "t")
    assert found == [f"handle:{PREFIX}a", f"handle:{PREFIX}b"]


async def test_the_lookups_share_one_deadline(
    monkeypatch: pytest.MonkeyPatch, released: threading.Event
) -> None:
    """Past the search's deadline, a lookup still under way is unknown and left out,
    whatever its own deadline: the holder's start waits for the search at most that."""
    names = [f"{PREFIX}a", f"{PREFIX}slow"]

    def before_answer(name: str) -> None:
        if name.endswith("slow"):
            released.wait()

    use(monkeypatch, Gcs(names, before_answer))
    monkeypatch.setattr(named, "LOOKUP_TIMEOUT_S", 600.0)
    async with asyncio.timeout(10):  # the held thread is released only after the test
        found = await left_by("holder", "t", timeout_s=0.3)
    assert found == [f"handle:{PREFIX}a"]
