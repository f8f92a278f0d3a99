"""torpor's metrics, exported through Ray's metrics API next to Ray's own.

Ray ships these to its Prometheus endpoint on every node, so an operator scrapes one
place. Ratios (stale-callback drops, dedup hits, commit conflicts) are exported as their
two counters; Prometheus divides. Each process creates its metric objects once, lazily,
because they need a connected Ray worker.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torpor.service.sweeper import SweepReport
    from torpor.session import ActivationResult

RESUME_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
LAG_BUCKETS = [0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600]


@dataclass(frozen=True)
class Spec:
    """One metric: its exported name, type, help text, labels and (histograms) buckets."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


# Every metric torpor exports, by the short key the code uses. deploy/ (dashboard, alert
# and recording rules) may reference only these names (a test checks).
SPECS: dict[str, Spec] = {
    "webhooks": Spec(
        "torpor_webhooks_total",
        "counter",
        "Inbound webhooks by outcome (accepted, duplicate, rejected) and reason.",
        ("source", "outcome", "reason"),
    ),
    "events": Spec(
        "torpor_events_total",
        "counter",
        "Inbox events by what the gates did with them (applied or observed).",
        ("verdict", "reason"),
    ),
    "transitions": Spec(
        "torpor_session_transitions_total",
        "counter",
        "Committed lifecycle transitions by target state.",
        ("state",),
    ),
    "commits": Spec(
        "torpor_commits_total",
        "counter",
        "Activation outcomes (ran, busy, conflict, lease_lost, ...).",
        ("outcome",),
    ),
    "alerts": Spec(
        "torpor_security_alerts_total",
        "counter",
        "Waits the State Invalidation Guard blocked.",
        ("tool",),
    ),
    "resume": Spec(
        "torpor_resume_latency_seconds",
        "histogram",
        "Activation requested to first agent step.",
        ("placement",),
        tuple(RESUME_BUCKETS),
    ),
    "outbox_lag": Spec(
        "torpor_outbox_lag_seconds",
        "histogram",
        "Outbox entry recorded to dispatched.",
        ("kind",),
        tuple(LAG_BUCKETS),
    ),
    "suspended": Spec(
        "torpor_suspended_sessions",
        "gauge",
        "Sessions suspended (waiting), as last counted by the reconciler.",
    ),
    "dead_letters": Spec(
        "torpor_dead_letters_total",
        "counter",
        "Outbox entries that gave up for good (resend with resend_outbox).",
        ("kind",),
    ),
    "sweep_failures": Spec(
        "torpor_sweep_step_failures_total",
        "counter",
        "Reconciler sweep steps that raised (the other steps still ran).",
        ("step",),
    ),
    "last_sweep": Spec(
        "torpor_reconciler_last_sweep_timestamp_seconds",
        "gauge",
        "Start of the last complete sweep; its age is time() minus this.",
    ),
    "store_trouble": Spec(
        "torpor_object_store_trouble",
        "gauge",
        "1 while the object store reports trouble it serves through (a local folder whose"
        " write-ahead log no longer checkpoints; /healthz warnings say why), else 0;"
        " set by each reconciler sweep.",
    ),
    "sweep_duration": Spec(
        "torpor_reconciler_sweep_seconds",
        "histogram",
        "Duration of complete reconciler sweeps.",
        (),
        tuple(LAG_BUCKETS),
    ),
    "activations_deferred": Spec(
        "torpor_activations_deferred_total",
        "counter",
        "Activation requests left to a timer (backpressure or failure).",
        ("reason",),
    ),
    "standbys": Spec(
        "torpor_standby_actors_total",
        "counter",
        "Standby session actors started, lost (stopped answering and replaced), and"
        " inherited (taken over from a restarted holder's predecessor).",
        ("event",),
    ),
    "deliveries": Spec(
        "torpor_notifications_total",
        "counter",
        "Outbound notification attempts by outcome.",
        ("outcome",),
    ),
}


@cache
def metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    made: dict[str, Any] = {}
    for key, spec in SPECS.items():
        if spec.kind == "counter":
            made[key] = Counter(spec.name, description=spec.description, tag_keys=spec.tags)
        elif spec.kind == "gauge":
            made[key] = Gauge(spec.name, description=spec.description, tag_keys=spec.tags)
        else:
            made[key] = Histogram(
                spec.name,
                description=spec.description,
                boundaries=list(spec.boundaries),
                tag_keys=spec.tags,
            )
    return made


@dataclass
class Readings:
    """What the code recorded while a :func:`tap` was open: (name, value, tags) by kind.
    Tests read metric values here, by their exported names."""

    records: list[tuple[str, str, float, dict[str, str]]] = field(default_factory=list)

    def _matching(self, name: str, kind: str, tags: dict[str, str]) -> list[float]:
        return [
            value
            for n, k, value, t in self.records
            if n == name and k == kind and all(t.get(key) == v for key, v in tags.items())
        ]

    def counter(self, name: str, **tags: str) -> float:
        """The sum of increments of counter ``name`` whose tags include ``tags``."""
        return sum(self._matching(name, "counter", tags))

    def observations(self, name: str, **tags: str) -> list[float]:
        return self._matching(name, "histogram", tags)

    def gauge(self, name: str) -> float | None:
        values = self._matching(name, "gauge", {})
        return values[-1] if values else None


_TAPS: list[Readings] = []


@contextmanager
def tap() -> Iterator[Readings]:
    """Record every metric this process writes while open (with or without Ray)."""
    readings = Readings()
    _TAPS.append(readings)
    try:
        yield readings
    finally:
        _TAPS.remove(readings)


def _record(key: str, value: float, tags: dict[str, str] | None) -> None:
    spec = SPECS[key]
    for readings in _TAPS:
        readings.records.append((spec.name, spec.kind, value, dict(tags or {})))


def _enabled() -> bool:
    # Metrics need a connected Ray worker; the CLI and unit tests run without one, and a
    # metric must never fail the request it describes.
    import ray

    return bool(ray.is_initialized())


# Counter increments are summed here and handed to Ray at most once a FLUSH_S: Ray's
# ``Counter.inc`` (tag checks, a call into its core worker) cost more of a webhook's event
# loop time than verifying, routing and storing it (15 % against 18 % under load). A
# process flushes before it exits (``flush``), so a session actor that records and then
# exits loses nothing.
FLUSH_S = 1.0
_pending: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
_pending_lock = threading.Lock()
_flush_armed = False


def inc(name: str, tags: dict[str, str] | None = None, value: float = 1.0) -> None:
    global _flush_armed
    _record(name, value, tags)
    if not _enabled():
        return
    key = (name, tuple(sorted(tags.items())) if tags else ())
    with _pending_lock:
        _pending[key] = _pending.get(key, 0.0) + value
        if _flush_armed:
            return
        _flush_armed = True
    try:
        asyncio.get_running_loop().call_later(FLUSH_S, flush)
    except RuntimeError:  # no event loop here (a thread, a script): hand it over now
        flush()


def flush() -> None:
    """Hand the summed counter increments to Ray."""
    global _flush_armed
    with _pending_lock:
        pending = dict(_pending)
        _pending.clear()
        _flush_armed = False
    if not pending or not _enabled():
        return
    # Never fails its caller: an actor on its way out, or a process exiting while Ray
    # shuts down, loses at most these counts, not its exit.
    with contextlib.suppress(Exception):
        made = metrics()
        for (name, tags), value in pending.items():
            made[name].inc(value, tags=dict(tags))


atexit.register(flush)


def observe(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    _record(name, value, tags)
    if _enabled():
        metrics()[name].observe(value, tags=tags or {})


def gauge(name: str, value: float) -> None:
    _record(name, value, None)
    if _enabled():
        metrics()[name].set(value)


def activation(result: ActivationResult, *, placement: str) -> None:
    """Record one activation: its outcome (conflicts and busy leases included) and, when
    the agent stepped, the resume latency from request to first step."""
    inc("commits", {"outcome": result.outcome.value})
    if result.resume_latency_s is not None:
        observe("resume", result.resume_latency_s, {"placement": placement})


def sweep(report: SweepReport) -> None:
    """Record what one reconciler sweep counted (the suspended sessions) and whether the
    object store reports trouble."""
    if report.suspended is not None:
        gauge("suspended", report.suspended)
    gauge("store_trouble", 0.0 if report.store_trouble is None else 1.0)
