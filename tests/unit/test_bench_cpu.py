"""bench/bench_ingress.py's CPU per request: two readings of every process, compared
process by process, each named once whatever task it runs."""

from __future__ import annotations

from bench.bench_ingress import cpu_share, cpu_used, short_name

REPLICA, HOST, NEW = 4321, 5000, 6000


def test_a_worker_whose_title_changed_between_readings_counts_only_what_it_used_meanwhile() -> None:
    """Compared by name, a replica titled after a health check in one reading and not in
    the other counted all its CPU since it started (one run printed 3.91 ms a webhook at
    823 webhooks/s). By process: what it used in between, under its later name; a
    process started meanwhile counts all of its own."""
    before = {
        REPLICA: ("ray::ServeReplica:app:Ingress.check_health", 100.0),
        HOST: ("ray::PoolHost", 50.0),
    }
    after = {
        REPLICA: ("ray::ServeReplica:app:Ingress", 101.5),
        HOST: ("ray::PoolHost", 50.5),
        NEW: ("wrk", 0.25),
    }
    assert cpu_used(before, after) == {
        "ray::ServeReplica:app:Ingress": 1.5,
        "ray::PoolHost": 0.5,
        "wrk": 0.25,
    }
    assert cpu_share(before, after, 1000).startswith("ray::ServeReplica:app:Ingress 1.50, ")


def test_a_ray_workers_name_leaves_out_the_task_it_runs() -> None:
    assert (
        short_name([b"ray::ServeReplica:deferred:Ingress.check_health", b""], "ray::ServeRepli")
        == short_name([b"ray::ServeReplica:deferred:Ingress", b""], "ray::ServeRepli")
        == "ray::ServeReplica:deferred:Ingress "
    )
    assert short_name([b"ray::PoolHost.run", b""], "ray::PoolHost") == "ray::PoolHost "
    assert short_name([b"/usr/bin/redis-server", b"*:6379"], "redis-server") == "redis-server"
    assert short_name([b""], "kworker/1:2") == "kernel kworker"
