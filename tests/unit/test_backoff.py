"""Retry delays: exponential and capped, or from a fixed schedule; jittered both ways."""

from __future__ import annotations

import random

from torpor.backoff import backoff_s, schedule_delay_s


def test_the_delay_doubles_with_each_attempt() -> None:
    delays = [backoff_s(n, base_s=2.0, cap_s=1000.0, jitter=0) for n in range(5)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0]


def test_the_delay_stops_growing_at_the_cap() -> None:
    assert backoff_s(9, base_s=2.0, cap_s=600.0, jitter=0) == 600.0
    assert backoff_s(10_000, base_s=2.0, cap_s=600.0, jitter=0) == 600.0  # no overflow


def test_jitter_spreads_delays_within_its_band() -> None:
    rng = random.Random(1)
    delays = [backoff_s(3, base_s=1.0, cap_s=100.0, jitter=0.2, rng=rng) for _ in range(200)]
    assert all(6.4 <= d <= 9.6 for d in delays)
    assert len(set(delays)) > 100  # a fleet does not retry in step
    assert min(delays) < 7.0 and max(delays) > 9.0  # both sides of the band are used


def test_the_same_seed_gives_the_same_delays() -> None:
    first = backoff_s(2, base_s=1.0, cap_s=10.0, rng=random.Random(5))
    again = backoff_s(2, base_s=1.0, cap_s=10.0, rng=random.Random(5))
    assert first == again


class Lowest(random.Random):
    """Always draws the bottom of the jitter band."""

    def uniform(self, a: float, b: float) -> float:
        return a


def test_a_delay_is_never_negative() -> None:
    assert backoff_s(0, base_s=1.0, cap_s=10.0, jitter=5.0, rng=Lowest()) == 0.0
    assert schedule_delay_s(0, [1.0], jitter=5.0, rng=Lowest()) == 0.0


def test_a_schedule_gives_its_delays_in_order_then_none() -> None:
    schedule = [5.0, 300.0, 1800.0]
    assert [schedule_delay_s(n, schedule, jitter=0) for n in range(4)] == [
        5.0,
        300.0,
        1800.0,
        None,
    ]


def test_a_schedule_is_jittered_within_its_band() -> None:
    rng = random.Random(2)
    delays = [schedule_delay_s(1, [5.0, 300.0], rng=rng) for _ in range(100)]
    assert all(d is not None and 240.0 <= d <= 360.0 for d in delays)
    assert len(set(delays)) > 50
