"""The one dependency bag: every port a process talks through, wired once.

``actors.wiring.open_services`` fills it from settings; tests fill it with memory
adapters. The session core and the application services take this bag and nothing else;
the session core reads its settings from ``RuntimeConfig``, never from ``Settings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from torpor.plugins import PluginResolver
from torpor.ports.activation import ActivationQueue
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
    RetentionRepository,
    SnapshotRepository,
    SubmitKeyRepository,
)
from torpor.ports.routing import CallbackRouter, Notifier
from torpor.ports.slots import RunningSlots
from torpor.settings import Settings
from torpor.work import ProgressRepository


@dataclass(frozen=True)
class RuntimeConfig:
    """The few settings the session core uses, typed for it."""

    lease_ttl: timedelta  # a holder that stops renewing is gone after this
    heartbeat_period: timedelta  # how often a running activation renews its lease
    binding_grace: timedelta  # an index binding outlives its wait's deadline by this
    retry_delay: timedelta  # a conflicted or failed activation is retried after this
    notify_on: frozenset[str]  # session events sent to the submitter's callback URL
    # Deadlines: every call out is bounded, and so is one activation as a whole.
    tool_timeout: timedelta = timedelta(seconds=60)  # a tool call whose tool sets none
    agent_step_timeout: timedelta = timedelta(seconds=300)  # one agent.step
    activation_cap: timedelta = timedelta(minutes=15)  # then checkpoint, retry later
    # The one backoff of the session core's retries (agent, guard, failed activations).
    retry_base: timedelta = timedelta(seconds=2)
    retry_cap: timedelta = timedelta(minutes=10)

    @classmethod
    def from_settings(cls, settings: Settings) -> RuntimeConfig:
        return cls(
            lease_ttl=timedelta(seconds=settings.lease.ttl_s),
            heartbeat_period=timedelta(seconds=settings.lease.heartbeat_s),
            binding_grace=timedelta(seconds=settings.storage.binding_grace_s),
            retry_delay=timedelta(seconds=settings.reconciler.interval_s),
            notify_on=frozenset(settings.notifications.on),
            tool_timeout=timedelta(seconds=settings.runtime.tool_timeout_s),
            agent_step_timeout=timedelta(seconds=settings.runtime.agent_step_timeout_s),
            activation_cap=timedelta(seconds=settings.runtime.activation_max_s),
            retry_base=timedelta(seconds=settings.runtime.retry_backoff_base_s),
            retry_cap=timedelta(seconds=settings.runtime.retry_backoff_cap_s),
        )


@dataclass
class Services:
    settings: Settings
    config: RuntimeConfig
    store: ObjectStore
    index: Index
    snapshots: SnapshotRepository
    inbox: InboxRepository
    correlations: CorrelationRepository
    batches: BatchRepository
    submit_keys: SubmitKeyRepository
    deliveries: DeliveryRepository
    audit: AuditRepository
    plugins: PluginResolver
    clock: Clock
    router: CallbackRouter
    notifier: Notifier | None = None
    observer: Observer = field(default_factory=Observer)
    retention: RetentionRepository | None = None  # None: nothing is ever deleted
    # Progress reported by running compute work (``torpor.work``); None: not kept.
    progress: ProgressRepository | None = None
    # Caps on RUNNING batch sessions; None where the index cannot share them (SQLite).
    slots: RunningSlots | None = None
    # Activation requests to pool hosts through the index's server; None: Ray calls.
    activations: ActivationQueue | None = None

    async def close(self) -> None:
        if self.slots is not None:
            await self.slots.close()
        if self.activations is not None:
            await self.activations.close()
        await self.audit.close()
        await self.plugins.close()
        await self.index.close()
        await self.store.close()
