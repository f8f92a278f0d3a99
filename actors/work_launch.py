"""A Ray work as its tool declares it and its watcher starts it: its kind (a task, an
actor's method or a Job), its ``Launch`` (pickled to the watcher with the order), the
``WorkContext`` its function is given (progress reports go to the watcher), and the
watcher's name, ``work:{work id}``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import ray
from ray.exceptions import RayError

from torpor.tools import ToolSpec
from torpor.work import Resources

log = logging.getLogger(__name__)


def watcher_name(work_id: str) -> str:
    return f"work:{work_id}"


class Kind(StrEnum):
    TASK = "task"
    ACTOR = "actor"
    JOB = "job"


@dataclass(frozen=True)
class Launch:
    """How a run is started: pickled to the watcher with the order."""

    kind: Kind
    resources: Resources = field(default_factory=Resources)
    fn: Any = None  # TASK: fn(args, ctx) -> JSON
    actor: str | None = None  # ACTOR: a named actor, and the method to call on it
    actor_namespace: str | None = None
    method: str | None = None
    entrypoint: Any = None  # JOB: fn(args) -> shell command
    job_address: str | None = None  # JOB: the dashboard (None: this cluster's)


@dataclass
class WorkContext:
    """What the work function is given: who it works for, and a way to report progress."""

    session_id: str
    tenant: str
    work_id: str
    tool_name: str
    idempotency_key: str
    run: int
    namespace: str
    _watcher: Any = None

    def progress(self, fraction: float, message: str = "") -> None:
        """Report progress: shown in the session's view and stream, wakes nothing.
        Fire and forget: a lost report is replaced by the next one. The watcher hands
        its own handle in the context, so a report asks the GCS nothing: looked up by
        name in the work function, a slow GCS held the caller (an async actor's whole
        loop, for an actor's method) for up to Ray's 60 s. A context without it looks
        the watcher up; one that cannot be looked up now (the GCS did not answer within
        Ray's deadline, or the watcher is gone) loses this report and is looked up
        again at the next: the lookup's error reached the work function, and a report,
        advisory, failed the work for good (``work_error``)."""
        if self._watcher is None:
            try:
                self._watcher = ray.get_actor(watcher_name(self.work_id), namespace=self.namespace)
            except (RayError, ValueError):  # ValueError: no actor by that name
                log.warning("work %s: its progress report is lost", self.work_id, exc_info=True)
                return
        self._watcher.progress.remote(max(0.0, min(1.0, float(fraction))), str(message)[:500])


def _spec(name: str, description: str, parameters: dict[str, Any] | None) -> ToolSpec:
    return ToolSpec(
        name=name,
        description=description,
        parameters=parameters or {"type": "object", "properties": {}},
    )
