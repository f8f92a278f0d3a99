"""Every benchmark that needs no Ray runs to its end at a tiny size, against the real
Redis and the local folder (and, for ``bench_storage``, the S3 test server).

A bench is code too, and nothing else runs it: ``bench_scale.py``'s synthetic writer
fell behind the index's bind script and died at its first batch for five days before
anyone measured target 4 again. The figures printed here mean nothing at these sizes;
that each script finishes, and prints its figure beside its target where it has one
(met or not: at these sizes on a loaded machine that is noise), is what is checked.
The benches that start Ray run the same way in ``tests/ray/test_benches_with_ray.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.slow

# (script and tiny-size arguments, a phrase its last lines must hold)
BENCHES = [
    (["bench_storage.py", "--rounds", "5", "--waits", "200"], "B [target <= 300 B] -> "),
    (["bench_snapshots.py", "--steps", "130"], "over step 100: "),
    (
        [
            "bench_scale.py",
            *("--sessions", "2000", "--object-sessions", "100", "--ended", "100"),
            *("--seconds", "1", "--rate", "50"),
        ],
        "(target <= 1.0 s)",
    ),
    (["bench_listing.py", "--keys", "300"], "target: repair bounded by live sessions"),
    (
        ["bench_local_store.py", "--n", "30", "--churn", "20", "--restart", "20"],
        "compare-and-swap",
    ),
    (["bench_round_trips.py", "--n", "30"], "CPU per lone round trip"),
    (["bench_batch.py", "--accept-only", "--n", "30", "--rounds", "1"], "to_202_s_max"),
    (["profile_gateway.py", "--n", "60", "--timeline"], "answered (202)"),
    (["profile_gateway.py", "--n", "40", "--instructions"], "M instructions each"),
]


@pytest.mark.parametrize(("args", "phrase"), BENCHES, ids=[a[0] for a, _ in BENCHES])
def test_the_bench_runs_to_its_end(
    args: list[str], phrase: str, redis_url: str, tmp_path: Path
) -> None:
    env = {"TORPOR_BENCH_REDIS": redis_url, "TMPDIR": str(tmp_path)}
    run_bench(args, phrase, env=env, timeout_s=240)
