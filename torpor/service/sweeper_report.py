"""What one sweep (``torpor.service.sweeper``) did: its counts, the steps and polls that
failed, and the trouble the object store reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SweepReport:
    timeouts: int = 0
    polls: int = 0
    poll_hits: int = 0
    recovered: int = 0
    retried: int = 0
    woken: int = 0  # activation timers that fired (the name is part of the report's output)
    deliveries: int = 0
    fan_outs: int = 0  # batch fan-outs resumed
    repaired_waits: int = 0
    repaired_sessions: int = 0
    suspended: int | None = None
    purged: int = 0
    purged_batches: int = 0  # batches deleted whole, past the retention period
    errors: list[str] = field(default_factory=list)
    # What the object store reports is wrong while it serves (``ReportsTrouble``: a local
    # folder whose log no longer checkpoints), as /healthz's warnings: read each sweep so
    # that the reconciler exports it (``torpor_object_store_trouble``) for an alert.
    store_trouble: str | None = None
