"""Every seam the core talks through, in one place.

Storage protocols (object store, index, repositories), the observer, callback routing and
notification, the activator and the clock. Adapters live in ``storage/`` and ``actors/``
and are chosen by the composition root (``actors.wiring``).
"""

from torpor.ports.activation import ActivationQueue, Activator, Reason, Wanted
from torpor.ports.clock import Clock
from torpor.ports.index import (
    Admission,
    ClaimIndex,
    IdempotencyRecord,
    IdempotencyStatus,
    Index,
    IndexHealth,
    Lease,
    LeaseIndex,
    SessionEntry,
    SessionPage,
    SessionRegistry,
    TimerIndex,
    TimerKind,
    WaitBinding,
    WaitIndex,
)
from torpor.ports.objects import (
    ListPage,
    MovesObjects,
    ObjectStore,
    ReportsTrouble,
    Staged,
    StagesCreates,
    StagesReplaces,
    StoredObject,
    WalksObjects,
    already_durable,
    trouble_of,
)
from torpor.ports.observer import Observer
from torpor.ports.repositories import (
    AuditRepository,
    BatchRepository,
    CorrelationRepository,
    DeliveryRepository,
    InboxRepository,
    RetentionReport,
    RetentionRepository,
    SnapshotRepository,
    Stored,
    SubmitKey,
    SubmitKeyRepository,
)
from torpor.ports.routing import CallbackRouter, Notifier
from torpor.ports.slots import RunningSlots, SlotEntry, SlotUsage

__all__ = [
    "ActivationQueue",
    "Activator",
    "Admission",
    "AuditRepository",
    "BatchRepository",
    "CallbackRouter",
    "ClaimIndex",
    "Clock",
    "CorrelationRepository",
    "DeliveryRepository",
    "IdempotencyRecord",
    "IdempotencyStatus",
    "InboxRepository",
    "Index",
    "IndexHealth",
    "Lease",
    "LeaseIndex",
    "ListPage",
    "MovesObjects",
    "Notifier",
    "ObjectStore",
    "Observer",
    "Reason",
    "ReportsTrouble",
    "RetentionReport",
    "RetentionRepository",
    "RunningSlots",
    "SessionEntry",
    "SessionPage",
    "SessionRegistry",
    "SlotEntry",
    "SlotUsage",
    "SnapshotRepository",
    "Staged",
    "StagesCreates",
    "StagesReplaces",
    "Stored",
    "StoredObject",
    "SubmitKey",
    "SubmitKeyRepository",
    "TimerIndex",
    "TimerKind",
    "WaitBinding",
    "WaitIndex",
    "WalksObjects",
    "Wanted",
    "already_durable",
    "trouble_of",
]
