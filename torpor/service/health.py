"""What ``/healthz`` reports: the index and the object store answer, and the reconciler
completed a sweep recently.

Each check has its own short deadline, so a hung dependency makes the answer "unhealthy",
never a hung health check. The sweep check reads the time of the last complete sweep
(every step ran) that the reconciler records in the index; it is stale past
``STALE_AFTER_INTERVALS`` sweep intervals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from torpor.ports.objects import trouble_of
from torpor.ports.services import Services
from torpor.problems import UNAVAILABLE_RETRY_AFTER_S, ProblemSpec

CHECK_TIMEOUT_S = 2.0
STALE_AFTER_INTERVALS = 6
PROBE_PREFIX = "health/"  # listing an empty prefix is the cheapest round trip to the store


@dataclass(frozen=True)
class Health:
    problems: list[str] = field(default_factory=list)
    last_sweep_age_s: float | None = None
    # Trouble that does not make the replica unhealthy (it serves; a restart or taking
    # it out of service would not cure it) but an operator must hear of.
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


async def _probe(name: str, call: Awaitable[object], problems: list[str]) -> bool:
    try:
        await asyncio.wait_for(call, timeout=CHECK_TIMEOUT_S)
    except Exception as exc:
        problems.append(f"{name}: {type(exc).__name__}")
        return False
    return True


async def check_health(services: Services, *, now: datetime, sweeps: bool) -> Health:
    """Probe the index and the store; with ``sweeps``, also the age of the last sweep."""
    problems: list[str] = []
    index_ok = await _probe("index", services.index.ping(), problems)
    await _probe("object store", services.store.list(PROBE_PREFIX, limit=1), problems)
    trouble = trouble_of(services.store)
    warnings = [] if trouble is None else [f"object store: {trouble}"]
    if not sweeps or not index_ok:
        return Health(problems, warnings=warnings)
    try:
        last = await asyncio.wait_for(services.index.last_sweep(), timeout=CHECK_TIMEOUT_S)
    except Exception as exc:
        return Health([*problems, f"index: {type(exc).__name__}"], warnings=warnings)
    if last is None:
        return Health([*problems, "reconciler: no complete sweep recorded"], warnings=warnings)
    age = (now - last).total_seconds()
    limit = STALE_AFTER_INTERVALS * services.settings.reconciler.interval_s
    if age > limit:
        problems.append(f"reconciler: last complete sweep {age:.0f} s ago")
    return Health(problems, age, warnings)


async def health_answer(
    services: Services,
    reconciler: object,
    version: str,
    ingress: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``/healthz`` as keyword arguments of a JSON response: 200 when healthy, else 503
    problem+json naming what is down. The sweep age counts only where this app runs a
    reconciler (``reconciler`` is its handle, or None). ``ingress``: what the edge says
    of its own paths, reported as is."""
    now = services.clock.now()
    health = await check_health(services, now=now, sweeps=reconciler is not None)
    if health.ok:
        # audit_ok: whether the last audit block landed (a failed one failed its webhooks;
        # the writer recovers on its next append, so it does not make the replica unhealthy).
        content = {
            "ok": True,
            "version": version,
            "last_sweep_age_s": health.last_sweep_age_s,
            "audit_ok": services.audit.healthy,
            "warnings": health.warnings,
        }
        if ingress is not None:
            content["ingress"] = dict(ingress)
        return {"content": content, "status_code": 200}
    detail = "; ".join(health.problems + health.warnings)
    spec = ProblemSpec(503, "unhealthy", "Unhealthy", detail, UNAVAILABLE_RETRY_AFTER_S)
    return {
        "content": spec.body("/healthz"),
        "status_code": 503,
        "media_type": "application/problem+json",
        "headers": {"Retry-After": str(spec.retry_after)},
    }
