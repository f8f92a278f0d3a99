"""Counter increments reach Ray summed, at most once a second per tag set, instead of
one call into Ray's core worker per webhook (which cost more than the webhook's own
work); nothing summed is lost when the process flushes before it exits."""

from __future__ import annotations

from typing import Any

import pytest

from actors import metrics
from tests.conftest import eventually


class RayCounter:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append((value, tags))


@pytest.fixture
def ray_counters(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    made = {key: RayCounter() for key in metrics.SPECS}
    monkeypatch.setattr(metrics, "_enabled", lambda: True)
    monkeypatch.setattr(metrics, "metrics", lambda: made)
    metrics.flush()
    return made


async def test_a_burst_of_increments_reaches_ray_as_one_sum_per_tag_set(
    ray_counters: dict[str, RayCounter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics, "FLUSH_S", 0.05)
    accepted = {"source": "oa", "outcome": "accepted", "reason": ""}
    for _ in range(500):
        metrics.inc("webhooks", accepted)
    metrics.inc("webhooks", {"source": "oa", "outcome": "rejected", "reason": "signature"})
    assert ray_counters["webhooks"].calls == [], "nothing crosses into Ray per request"
    # the armed hand-over runs on the loop
    await eventually(lambda: ray_counters["webhooks"].calls, timeout_s=5, what="hand-over")
    assert sorted(ray_counters["webhooks"].calls, key=lambda c: c[0]) == [
        (1.0, {"outcome": "rejected", "reason": "signature", "source": "oa"}),
        (500.0, accepted),
    ]


def test_without_an_event_loop_an_increment_is_handed_over_at_once(
    ray_counters: dict[str, RayCounter],
) -> None:
    metrics.inc("commits", {"outcome": "ran"})
    assert ray_counters["commits"].calls == [(1.0, {"outcome": "ran"})]


async def test_flush_hands_over_what_is_pending_before_an_exit(
    ray_counters: dict[str, RayCounter],
) -> None:
    metrics.inc("transitions", {"state": "suspended"}, value=2)
    metrics.flush()  # what SessionActor._exit does before ray.actor.exit_actor()
    assert ray_counters["transitions"].calls == [(2.0, {"state": "suspended"})]
    metrics.flush()
    assert len(ray_counters["transitions"].calls) == 1, "handed over once"
