"""torpor's metrics, exported through Ray's metrics API next to Ray's own.

Ray ships these to its Prometheus endpoint on every node, so an operator scrapes one
place. Ratios (stale-callback drops, dedup hits, commit conflicts) are exported as their
two counters; Prometheus divides. Each process creates its metric objects once, lazily,
because they need a connected Ray worker.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torpor.session import ActivationResult

RESUME_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
LAG_BUCKETS = [0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600]


@cache
def metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    return {
        "webhooks": Counter(
            "torpor_webhooks_total",
            description="Inbound webhooks by outcome (accepted, duplicate, rejected) and reason.",
            tag_keys=("source", "outcome", "reason"),
        ),
        "events": Counter(
            "torpor_events_total",
            description="Inbox events by what the gates did with them (applied or observed).",
            tag_keys=("verdict", "reason"),
        ),
        "transitions": Counter(
            "torpor_session_transitions_total",
            description="Committed lifecycle transitions by target state.",
            tag_keys=("state",),
        ),
        "commits": Counter(
            "torpor_commits_total",
            description="Activation outcomes (ran, busy, conflict, lease_lost, ...).",
            tag_keys=("outcome",),
        ),
        "alerts": Counter(
            "torpor_security_alerts_total",
            description="Waits the State Invalidation Guard blocked.",
            tag_keys=("tool",),
        ),
        "resume": Histogram(
            "torpor_resume_latency_seconds",
            description="Activation requested to first agent step.",
            boundaries=RESUME_BUCKETS,
            tag_keys=("placement",),
        ),
        "outbox_lag": Histogram(
            "torpor_outbox_lag_seconds",
            description="Outbox entry recorded to dispatched.",
            boundaries=LAG_BUCKETS,
            tag_keys=("kind",),
        ),
        "suspended": Gauge(
            "torpor_suspended_sessions",
            description="Sessions suspended (waiting), as last counted by the reconciler.",
        ),
        "dead_letters": Counter(
            "torpor_dead_letters_total",
            description="Outbox entries that gave up for good (resend with resend_outbox).",
            tag_keys=("kind",),
        ),
        "sweep_failures": Counter(
            "torpor_sweep_step_failures_total",
            description="Reconciler sweep steps that raised (the other steps still ran).",
            tag_keys=("step",),
        ),
        "last_sweep": Gauge(
            "torpor_reconciler_last_sweep_timestamp_seconds",
            description="Start of the last complete sweep; its age is time() minus this.",
        ),
        "sweep_duration": Histogram(
            "torpor_reconciler_sweep_seconds",
            description="Duration of complete reconciler sweeps.",
            boundaries=LAG_BUCKETS,
        ),
        "activations_deferred": Counter(
            "torpor_activations_deferred_total",
            description="Activation requests left to a timer (backpressure or failure).",
            tag_keys=("reason",),
        ),
        "deliveries": Counter(
            "torpor_notifications_total",
            description="Outbound notification attempts by outcome.",
            tag_keys=("outcome",),
        ),
    }


def _enabled() -> bool:
    # Metrics need a connected Ray worker; the CLI and unit tests run without one, and a
    # metric must never fail the request it describes.
    import ray

    return bool(ray.is_initialized())


def inc(name: str, tags: dict[str, str] | None = None, value: float = 1.0) -> None:
    if _enabled():
        metrics()[name].inc(value, tags=tags or {})


def observe(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    if _enabled():
        metrics()[name].observe(value, tags=tags or {})


def gauge(name: str, value: float) -> None:
    if _enabled():
        metrics()[name].set(value)


def activation(result: ActivationResult, *, placement: str) -> None:
    """Record one activation: its outcome (conflicts and busy leases included) and, when
    the agent stepped, the resume latency from request to first step."""
    inc("commits", {"outcome": result.outcome.value})
    if result.resume_latency_s is not None:
        observe("resume", result.resume_latency_s, {"placement": placement})
