"""Every benchmark that starts Ray runs to its end at a tiny size, each on a local Ray
of its own (the bench's, not this module's), the real Redis and, for the ingress bench,
HAProxy and wrk.

These are the benches behind targets 1 to 3 of the speed issue, and the chaos run; they
were run by hand only, and a bench nobody runs breaks unseen (two did, found by
``tests/storage/test_benches_run.py`` on its first run). The figures mean nothing at
these sizes on a machine running a test suite; that each script gets through every
phase and prints its report, with its targets where it has them, is what is checked.
About 2 minutes in all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.slow

BENCHES = [
    (["bench_ray_work.py", "--sessions", "2"], '"p99_ms"'),
    # Its own limits well inside the test's: a session that never gets there is reported
    # with every session's state, not cut off with nothing said.
    (
        ["bench_chaos.py", "--sessions", "10", "--wait-timeout-s", "60", "--drain-timeout-s", "60"],
        "CHAOS OK",
    ),
    (["bench_batch.py", "--n", "5"], '"object_bytes_per_session"'),
    (
        [
            "bench_runtime.py",
            *("--dedicated-n", "2", "--standby", "2", "--standby-n", "4"),
            *("--standby-sustained", "2", "--pooled-n", "5", "--suspended", "20"),
        ],
        "pooled / dedicated throughput",
    ),
    (
        [
            "bench_ingress.py",
            *("--proxy", "haproxy", "--duration", "1", "--sessions", "300"),
            *("--sequential", "10", "--resume-duration", "1"),
            # Its three waits for Ray to go quiet (a minute each on a machine whose Ray
            # daemons never do) are for figures; these mean nothing at this size.
            *("--settle-s", "0"),
        ],
        "[target p50 <= 5, p99 <= 10]",
    ),
]


@pytest.mark.parametrize(("args", "phrase"), BENCHES, ids=[a[0] for a, _ in BENCHES])
def test_the_bench_runs_to_its_end(
    args: list[str], phrase: str, redis_url: str, tmp_path: Path
) -> None:
    env = {
        "TORPOR_BENCH_REDIS": redis_url,
        "TMPDIR": str(tmp_path),  # the bench's own folders, removed with the test's
        "RAY_TMPDIR": "/tmp",  # Ray's sockets: a path under tmp_path can be too long
        "RAY_ADDRESS": "local",  # never a cluster someone else started on this machine
    }
    run_bench(args, phrase, env=env, timeout_s=280)
