"""A torpor deployment in one process: real storage, real Redis, the runtime inline."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from actors.wiring import open_services, session_runtime
from tests.conftest import eventually
from tests.support.tools import World, agent_config
from torpor.clock import ManualClock
from torpor.events import EventKind, InboxEvent
from torpor.models import SessionSnapshot, Wait
from torpor.ports import ObjectStore, StoredObject
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.sessions import SessionService
from torpor.settings import Settings
from torpor.webhooks.capability import mint

CAPABILITY_KEY = "test-capability-key-0123456789abcdef"


NOTIFY_KEY = "test-notify-key-0123456789abcdef"


def settings_for(
    tmp: Path,
    redis_url: str,
    prefix: str,
    *,
    index: str = "redis",
    extra: dict[str, Any] | None = None,
    **approval: Any,
) -> Settings:
    base: dict[str, Any] = {
        "notifications": {"key": NOTIFY_KEY, "allow_private_callbacks": True},
        "storage": {
            "object_store_url": f"file://{tmp / 'objects'}",
            "index_url": redis_url if index == "redis" else f"sqlite://{tmp / 'index.db'}",
            "redis_prefix": prefix,
        },
        "agents": agent_config(redis_url, prefix, **approval),
        "security": {"capability_keys": [CAPABILITY_KEY]},
        "lease": {"heartbeat_s": 0.2, "ttl_s": 2.0},
    }
    # A section in ``extra`` overrides single keys of the base section, not all of it.
    for key, value in (extra or {}).items():
        section = base.get(key)
        base[key] = {**section, **value} if isinstance(section, dict) and key != "agents" else value
    return Settings.build(base)


def callback(
    session_id: str,
    wait: Wait,
    *,
    event_id: str,
    data: Any,
    at: datetime,
    source: str = "oa",
    type: str = "oa.approval.decided",
) -> InboxEvent:
    """The OA system's answer to ``wait``, as the ingress would put it in the inbox."""
    return InboxEvent.answering(
        wait,
        kind=EventKind.CALLBACK,
        session_id=session_id,
        source=source,
        event_id=event_id,
        type=type,
        received_at=at,
        data=data,
    )


@dataclass
class Env:
    services: Services
    control: SessionService
    world: World
    clock: ManualClock

    async def submit(self, doc: str = "PR-1", amount: float = 100.0, **kw: Any) -> str:
        result = await self.control.submit(
            tenant="acme", agent="purchase", input={"doc": doc, "amount": amount}, **kw
        )
        return result.session_id

    async def load(self, session_id: str) -> SessionSnapshot:
        return await self.services.snapshots.load(session_id)

    async def capability_link(self, session_id: str) -> str:
        """The token of a capability link for the session's (first) open wait, minted
        with the test deployment's key, valid until the wait's deadline."""
        wait = (await self.load(session_id)).waits[0]
        return mint(
            key=CAPABILITY_KEY.encode(),
            tenant="acme",
            session_id=session_id,
            wait_id=wait.wait_id,
            correlation_id=wait.correlation_id,
            epoch=wait.epoch,
            expires_at=wait.deadline,
        )

    async def answer(
        self,
        session_id: str,
        data: Any,
        *,
        event_id: str = "evt-1",
        epoch: int | None = None,
        type: str = "oa.approval.decided",
        source: str = "oa",
    ) -> bool:
        """Deliver a callback for the session's (first) open wait, stamped as the ingress
        would stamp it from the index binding."""
        snap = await self.load(session_id)
        wait = snap.waits[0]
        binding = await self.services.index.resolve(
            tenant=snap.tenant, now=self.clock.now(), correlation_id=wait.correlation_id
        )
        assert binding is not None
        return await self.control.deliver(
            InboxEvent.new(
                kind=EventKind.CALLBACK,
                session_id=session_id,
                source=source,
                event_id=event_id,
                type=type,
                received_at=self.clock.now(),
                correlation_id=wait.correlation_id,
                epoch=binding.epoch if epoch is None else epoch,
                step_id=binding.step_id,
                data=data,
            )
        )


def keys_read(store: ObjectStore) -> list[str]:
    """Every key ``store.get`` is asked for from now on, in order (a live list): what a
    read path fetched, for tests that bound it."""
    read: list[str] = []
    original = store.get

    async def get(key: str, *, max_bytes: int | None = None) -> StoredObject:
        read.append(key)
        return await original(key, max_bytes=max_bytes)

    store.get = get  # type: ignore[method-assign]
    return read


async def deliver_cancel(services: Services, sid: str, *, at: datetime) -> None:
    """A cancel in the session's inbox (from its client): its next drive commits it."""
    await services.inbox.deliver(
        InboxEvent.new(
            kind=EventKind.CANCEL,
            session_id=sid,
            source="client",
            event_id="cancel-1",
            type="torpor.cancel",
            received_at=at,
        )
    )


async def held_by_a_dead_holder(env: Env, sid: str) -> None:
    """The session's lease, taken by a holder that died: it expires unreleased, by the
    Redis server's clock (leases follow it, not the caller's), so this waits for that
    clock rather than advance ours."""
    index = env.services.index
    lease = await index.acquire_lease(
        name=f"session:{sid}", owner="dead-host", ttl=timedelta(milliseconds=200),
        now=env.clock.now(),
    )  # fmt: skip
    assert lease is not None
    await eventually(
        lambda: index.expired_leases(now=env.clock.now(), limit=10),
        timeout_s=10,
        what="the lease expired on the server's clock",
    )


@asynccontextmanager
async def local_env(
    tmp: Path, redis_url: str, prefix: str, *, extra: dict[str, Any] | None = None, **approval: Any
) -> AsyncIterator[Env]:
    settings = settings_for(tmp, redis_url, prefix, extra=extra, **approval)
    clock = ManualClock()
    services = open_services(settings, clock=clock)
    control = SessionService(services, InlineActivator(session_runtime(services, "test-runtime")))
    world = World(redis_url, prefix)
    try:
        yield Env(services, control, world, clock)
    finally:
        await world.close()
        await services.close()


EnvFactory = Callable[..., Any]
