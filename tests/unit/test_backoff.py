"""The one retry-delay policy: exponential, capped, jittered; exact when tests ask."""

from __future__ import annotations

import random

from torpor import backoff
from torpor.backoff import Backoff


def test_full_jitter_stays_within_the_capped_exponential() -> None:
    policy = Backoff(base_s=1.0, cap_s=10.0, rng=random.Random(7))
    ceilings = [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [policy.ceiling_s(n) for n in range(6)] == ceilings
    for attempt, ceiling in enumerate(ceilings):
        delays = [policy.delay_s(attempt) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert min(delays) < ceiling / 4 and max(delays) > ceiling * 3 / 4, "spread over [0, c]"


def test_the_random_source_is_injectable() -> None:
    a = Backoff(base_s=1.0, cap_s=60.0, rng=random.Random(42))
    b = Backoff(base_s=1.0, cap_s=60.0, rng=random.Random(42))
    assert [a.delay_s(n) for n in range(8)] == [b.delay_s(n) for n in range(8)]


def test_proportional_jitter_and_no_jitter() -> None:
    spread = Backoff(base_s=60.0, cap_s=600.0, jitter=0.2, rng=random.Random(1))
    delays = [spread.delay_s(0) for _ in range(200)]
    assert all(48.0 <= d <= 72.0 for d in delays)
    exact = Backoff(base_s=0.05, cap_s=1.0, factor=1.5, jitter=0)
    assert [round(exact.delay_s(n), 4) for n in range(4)] == [0.05, 0.075, 0.1125, 0.1688]
    assert exact.delay_s(50) == 1.0


def test_a_huge_attempt_number_is_the_cap() -> None:
    policy = Backoff(base_s=2.0, cap_s=30.0, jitter=0)
    assert policy.delay_s(10_000) == 30.0
    assert Backoff(base_s=2.0, jitter=0).delay_s(10_000) == float("inf")


def test_a_schedule_runs_out() -> None:
    policy = Backoff(schedule=[5, 300, 1800], jitter=0)
    assert [policy.delay_s(n) for n in range(3)] == [5.0, 300.0, 1800.0]
    assert not policy.exhausted(2) and policy.exhausted(3)
    assert not Backoff(base_s=1.0).exhausted(10_000)


def test_fixed_makes_every_delay_exact_or_zero_and_restores() -> None:
    policy = Backoff(base_s=1.0, cap_s=10.0)
    with backoff.fixed():
        assert [policy.delay_s(n) for n in range(5)] == [1.0, 2.0, 4.0, 8.0, 10.0]
        with backoff.fixed(0):
            assert policy.delay_s(3) == 0.0
        assert policy.delay_s(3) == 8.0
    jittered = {policy.delay_s(3) for _ in range(20)}
    assert len(jittered) > 1, "outside the block the jitter is back"


def test_the_attempt_a_run_is_at_is_read_off_the_time_since_its_first() -> None:
    """Each attempt at its un-jittered time, give or take half its step: 60 s, 120 s, ...
    apart from 0 s, then the cap's 300 s; a run that keeps no count resumes there."""
    policy = Backoff(base_s=60.0, cap_s=300.0, jitter=0.2)
    starts = [0.0, 60.0, 180.0, 420.0, 720.0, 1020.0]  # attempts 0..5 (the cap from 3)
    for attempt, at in enumerate(starts):
        for jittered in (0.8, 1.0, 1.2):
            step = policy.ceiling_s(max(0, attempt - 1))
            assert policy.attempt_at(at + (jittered - 1) * step) == attempt, (attempt, jittered)
    assert policy.attempt_at(1020.0 + 300.0 * 1000) == 1005
    assert Backoff(base_s=0.0).attempt_at(1e9) == 0
    assert Backoff(base_s=1.0).attempt_at(1e300) > 900  # no cap: no end to the growth
    assert Backoff(schedule=[5, 30]).attempt_at(35 + 30 * 3) == 5  # at 0, 5, 35, 65, 95, 125 s
