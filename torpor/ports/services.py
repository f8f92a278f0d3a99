"""The one dependency bag: every port a process talks through, wired once.

``actors.wiring.open_services`` fills it from settings; tests fill it with memory
adapters. The session core and the application services take this bag and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torpor.plugins import PluginResolver
from torpor.ports.clock import Clock
from torpor.ports.index import Index
from torpor.ports.objects import ObjectStore
from torpor.ports.observer import Observer
from torpor.ports.repositories import (
    AuditRepository,
    BatchRepository,
    CorrelationRepository,
    DeliveryRepository,
    InboxRepository,
    SnapshotRepository,
)
from torpor.ports.routing import CallbackRouter, Notifier
from torpor.settings import Settings


@dataclass
class Services:
    settings: Settings
    store: ObjectStore
    index: Index
    snapshots: SnapshotRepository
    inbox: InboxRepository
    correlations: CorrelationRepository
    batches: BatchRepository
    deliveries: DeliveryRepository
    audit: AuditRepository
    plugins: PluginResolver
    clock: Clock
    router: CallbackRouter
    notifier: Notifier | None = None
    observer: Observer = field(default_factory=Observer)

    async def close(self) -> None:
        await self.audit.close()
        await self.plugins.close()
        await self.index.close()
        await self.store.close()
