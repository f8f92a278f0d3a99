"""The composition root: build the dependency bag from settings, once per process.

This is the only place that turns URLs into adapters for the runtime. It imports no Ray,
so the same wiring runs in a session actor, a pooled host, the reconciler, the Serve
replica, the CLI and the tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from actors.descriptors import reserve_descriptors
from actors.telemetry import configure_tracing
from storage.audit import ObjectAudit
from storage.batches import ObjectBatches
from storage.correlations import ObjectCorrelations
from storage.deliveries import ObjectDeliveries
from storage.factory import (
    index_url,
    open_activation_queue,
    open_index,
    open_object_store,
    open_slots,
)
from storage.inbox import ObjectInbox
from storage.probe import verify_conditional_writes
from storage.retention import ObjectRetention
from storage.snapshots import ObjectSnapshots
from storage.submit_keys import ObjectSubmitKeys
from storage.work import ObjectProgress
from torpor import logs
from torpor.callbacks import CapabilityRouter
from torpor.clock import SystemClock
from torpor.errors import ConfigError, TorporError
from torpor.outbox import BareRouter
from torpor.plugins import PluginResolver
from torpor.ports import CallbackRouter, Clock, Notifier, Observer
from torpor.ports.services import RuntimeConfig, Services
from torpor.service.deliveries import DeliveryNotifier
from torpor.session import SessionRuntime
from torpor.settings import Settings, resolve_secret

log = logging.getLogger(__name__)


def session_runtime(services: Services, owner: str | None = None) -> SessionRuntime:
    return SessionRuntime(services, owner=owner or default_owner())


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# Closes of services whose opener was cancelled, held until they finish.
_CLOSING: set[asyncio.Task[None]] = set()


async def opened_in_thread(
    open_: Callable[..., Services], settings: Settings, **kwargs: Any
) -> Services:
    """``open_(settings, **kwargs)`` (``open_services``) in a thread, for a caller on an
    event loop: it blocks (files, sockets, the descriptor table's growth, the store's
    first reads), and on the caller's loop it held every other coroutine there for as
    long. Cancelled while the thread opens, the services it opens are closed once it is
    done (a thread cannot be stopped): left open, their files and sockets lived as long
    as the process."""
    opening = asyncio.ensure_future(asyncio.to_thread(open_, settings, **kwargs))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_opened)
        raise


def _close_opened(opening: asyncio.Future[Services]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return  # nothing opened (the error was the cancelled caller's to see: it is gone)
    closing = asyncio.ensure_future(opening.result().close())
    _CLOSING.add(closing)
    closing.add_done_callback(_CLOSING.discard)


def open_services(
    settings: Settings,
    *,
    clock: Clock | None = None,
    notifier: Notifier | None = None,
    observer: Observer | None = None,
) -> Services:
    if settings.runtime.log_format == "json":  # every torpor process opens its services
        logs.configure("json")
    configure_tracing(settings)
    # What the configuration can refuse (an ``env:`` secret not set, a key too short),
    # before anything opens: a pool host that retries its open opened a store each time.
    keys = settings.capability_key_bytes()
    audit_key = resolve_secret(settings.security.audit_key) if settings.security.audit_key else None
    config = RuntimeConfig.from_settings(settings)
    index_at = index_url(settings)
    # Before the store opens its files: the table's growth waits for an RCU grace
    # period, here once instead of inside a request (``actors.descriptors``).
    reserve_descriptors()
    opened: list[_Closable] = []
    try:
        store = _kept(opened, open_object_store(settings))
        index = _kept(opened, open_index(settings, index_at))
        slots = _kept(opened, open_slots(settings, index))
        activations = _kept(opened, open_activation_queue(index))
        router: CallbackRouter = (
            CapabilityRouter(keys=keys, public_url=settings.public_url) if keys else BareRouter()
        )
        services = Services(
            settings=settings,
            config=config,
            store=store,
            index=index,
            snapshots=ObjectSnapshots(store),
            inbox=ObjectInbox(store),
            correlations=ObjectCorrelations(store),
            batches=ObjectBatches(store),
            submit_keys=ObjectSubmitKeys(store),
            deliveries=ObjectDeliveries(store),
            audit=ObjectAudit(store, key=audit_key),
            plugins=PluginResolver(settings),
            clock=clock or SystemClock(),
            router=router,
            notifier=notifier,
            observer=observer or Observer(),
            retention=ObjectRetention(store),
            progress=ObjectProgress(store),
            slots=slots,
            activations=activations,
        )
        if notifier is None:  # the notifier needs the very services it serves: set it after
            services.notifier = DeliveryNotifier(services)
    except BaseException:
        _discard(opened)
        raise
    return services


class _Closable(Protocol):
    async def close(self) -> None: ...


_T = TypeVar("_T", bound=_Closable | None)

# Closing what a failed open opened waits this long at most (a store that hangs).
DISCARD_TIMEOUT_S = 10.0


def _kept(opened: list[_Closable], part: _T) -> _T:
    if part is not None:
        opened.append(part)
    return part


def _discard(opened: list[_Closable]) -> None:
    """Close, last opened first, what an open that failed part way had opened: its
    files, its SQLite connection and worker thread, its sockets. The closes are
    coroutines and the open is not (it runs in a thread, or on a loop it must not
    re-enter), so they run on a loop of their own in a thread of their own. Never
    raises: the open's own error is the one its caller sees."""

    async def close_all() -> None:
        for part in reversed(opened):
            try:
                await part.close()
            except BaseException as exc:  # this thread's own loop: the rest still close
                # Its type only: a message may carry a URL's secret.
                log.warning(
                    "could not close %s after a failed open: %s",
                    type(part).__name__,
                    type(exc).__name__,
                )

    if not opened:
        return
    try:
        closing = threading.Thread(
            target=lambda: asyncio.run(close_all()), name="torpor-discard", daemon=True
        )
        closing.start()
        closing.join(DISCARD_TIMEOUT_S)
    except Exception as exc:  # a thread that could not start: left to the collector
        log.warning("could not close what a failed open opened: %s", type(exc).__name__)
        return
    if closing.is_alive():
        log.warning(
            "closing what a failed open opened took more than %.0f s; left to finish",
            DISCARD_TIMEOUT_S,
        )


_VERIFIED_STORES: set[str] = set()
# Readying the store at start waits this long at most: a store that hangs (an S3
# endpoint that does not answer) would otherwise hold the replica in STARTING for good.
WARM_TIMEOUT_S = 15.0


async def warm_services(services: Services, *, timeout_s: float = WARM_TIMEOUT_S) -> None:
    """Before a process takes traffic (a replica's constructor, a pool host before it
    listens): what its first request would otherwise do inside itself, what the store
    makes ahead and its check of conditional writes. The store first: the check writes
    through it, and a check that came first made the log's segment and set the store's
    own makers going, leaving the readying half done. Never raises: a store refused by
    its configuration is logged as the error it is (every write will report it too);
    one that cannot be readied now is readied by the first request."""
    try:
        async with asyncio.timeout(timeout_s):
            await services.store.warm()
            await ensure_conditional_writes(services)
    except ConfigError:
        log.error("the object store at %s is refused", services.store.url, exc_info=True)
    except (TorporError, OSError, TimeoutError):
        log.warning("could not ready the object store (the first write will)", exc_info=True)


async def ensure_conditional_writes(services: Services) -> None:
    """Once per process and store, before the first write that relies on them: refuse an
    object store that ignores conditional writes (``ConditionalWritesIgnored``). A failed
    check is asked again next time, so a store that gets fixed is taken back."""
    url = services.store.url
    if url in _VERIFIED_STORES:
        return
    await verify_conditional_writes(services.store)
    _VERIFIED_STORES.add(url)
