"""The Python client, for drivers on the cluster (notebooks, batch jobs, services).

    from torpor.client import Client

    with Client(tenant="acme") as client:
        sid = client.submit("purchase", {"doc": "PR-1"})
        view = client.wait(sid, timeout_s=3600)

    batch = client.submit_batch("purchase", documents)
    client.wait_batch(batch, on_progress=print)

    batch = client.submit_dataset(ray.data.read_json("docs/"), agent="purchase")
    results = client.read_results(batch, timeout_s=3600)  # a ray.data.Dataset

It connects to Ray (``address="auto"`` when a cluster is running, else a local Ray),
makes sure the detached reconciler is running, and talks to storage directly, so nothing
goes through HTTP. ``AsyncClient`` is the same for asyncio code
(``await AsyncClient.connect(...)`` there: the constructor blocks its caller).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import JsonValue

from torpor.events import EventKind, InboxEvent
from torpor.ids import checked_tenant
from torpor.lifecycle import SessionState
from torpor.models import ErrorInfo, SessionSnapshot
from torpor.settings import Settings

if TYPE_CHECKING:  # the actors (and Ray) are imported when a client connects
    from actors.config_ref import ConfigRef
    from actors.ray_activator import RayActivator
    from torpor.ports.services import Services

T = TypeVar("T")
# The key of a document passed by reference, in its session's input.
DOCUMENT_REF = "document_ref"


def plain(value: Any) -> JsonValue:
    """A Ray Data row as plain JSON: numpy scalars and arrays become Python values."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars, without importing numpy
        return plain(value.tolist())
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


@dataclass(frozen=True)
class WaitView:
    wait_id: str
    tool: str
    correlation_id: str
    business_key: str | None
    deadline: datetime


@dataclass(frozen=True)
class SessionView:
    session_id: str
    state: SessionState
    result: JsonValue
    error: ErrorInfo | None
    waits: list[WaitView]
    updated_at: datetime

    @classmethod
    def of(cls, snapshot: SessionSnapshot) -> SessionView:
        return cls(
            session_id=snapshot.session_id,
            state=snapshot.state,
            result=snapshot.result,
            error=snapshot.error,
            waits=[
                WaitView(w.wait_id, w.tool_name, w.correlation_id, w.business_key, w.deadline)
                for w in snapshot.waits
            ],
            updated_at=snapshot.updated_at,
        )

    @property
    def done(self) -> bool:
        return self.state.terminal


async def _opened(settings: Settings) -> Services:
    """``open_services(settings)`` in a thread (``opened_in_thread``): opened on the
    caller's loop, it held every other coroutine there for as long."""
    from actors.wiring import open_services, opened_in_thread

    return await opened_in_thread(open_services, settings)


def _init_ray(settings: Settings, address: str | None) -> None:
    """``ray.init`` in the calling thread, unless Ray is connected already. A SIGTERM
    handler the program set itself stays: Ray's (exit) goes in only where there was none.
    Either way abseil's three-second abort comes off SIGTERM (actors/driver.py)."""
    import ray

    from actors.driver import init_driver, keep_sigterm_in_python

    if ray.is_initialized():
        keep_sigterm_in_python()  # the program's own ``ray.init`` left abseil in front
        return
    init_driver(address=address, namespace=settings.namespace, log_to_driver=False)


class AsyncClient:
    def __init__(
        self,
        settings: Settings | None = None,
        *,
        tenant: str = "default",
        address: str | None = None,
        start_reconciler: bool = True,
    ) -> None:
        """Connects in the calling thread, and blocks it: ``ray.init``, the services'
        open, the count of the cluster's nodes that embedded storage's check makes
        (``ray.nodes``, a GCS call), and the reconciler's start. A constructor cannot
        await; from a coroutine, ``await AsyncClient.connect(...)`` makes the last three
        off the event loop."""
        from actors.ray_activator import RayActivator
        from actors.reconciler import ensure_reconciler
        from actors.wiring import open_services

        config = self._connect(settings, tenant=tenant, address=address)
        self._services = open_services(self.settings)
        self._use(RayActivator(self._services, config))
        if start_reconciler:
            ensure_reconciler(config)

    @classmethod
    async def connect(
        cls,
        settings: Settings | None = None,
        *,
        tenant: str = "default",
        address: str | None = None,
        start_reconciler: bool = True,
    ) -> AsyncClient:
        """As the constructor, for a caller on an event loop: the services open in a
        thread (``open_services`` blocks: files, sockets, the descriptor table's growth),
        and the GCS calls it waits for are made off the loop, each with its deadline (the
        node count's: the lookups', ``ClusterUnavailable`` past it; the reconciler's
        start: the time a process start may take). ``ray.init`` stays in the calling
        thread: Ray sets its SIGTERM handler only when that is the main thread."""
        from actors.ray_activator import RayActivator
        from actors.reconciler import ensure_reconciler

        client = cls.__new__(cls)
        config = client._connect(settings, tenant=tenant, address=address)
        client._services = await _opened(client.settings)
        try:
            activator = await RayActivator.made(client._services, config)
        except BaseException:
            await client._services.close()
            raise
        client._use(activator)
        if start_reconciler:
            try:
                # Bounded by its own deadlines (``ensure_reconciler``); in asyncio's
                # threads, not the lookups' pool, which it could hold for minutes.
                await asyncio.to_thread(ensure_reconciler, config)
            except BaseException:
                await client.close()
                raise
        return client

    def _connect(self, settings: Settings | None, *, tenant: str, address: str | None) -> ConfigRef:
        """Ray connected: the ``ConfigRef`` the actors are handed."""
        from actors.config_ref import ConfigRef

        self.tenant = checked_tenant(tenant)  # before anything connects
        # Settings read here from the environment may hold inline secrets: the actors are
        # then pointed at the file to read them themselves (actors/config_ref.py).
        self.settings = settings or Settings.from_env()
        config = ConfigRef.of(settings) if settings else ConfigRef.of_loaded(self.settings)
        _init_ray(self.settings, address)
        return config

    def _use(self, activator: RayActivator) -> None:
        from torpor.service.batches import BatchService
        from torpor.service.sessions import SessionService

        self._activator = activator
        self._control = SessionService(self._services, activator)
        self._batches = BatchService(self._control)

    async def submit(
        self,
        agent: str,
        input: JsonValue,
        *,
        metadata: dict[str, str] | None = None,
        callback_url: str | None = None,
        idempotency_key: str | None = None,
    ) -> str:
        submitted = await self._control.submit(
            tenant=self.tenant,
            agent=agent,
            input=input,
            metadata=metadata,
            callback_url=callback_url,
            idempotency_key=idempotency_key,
        )
        return submitted.session_id

    async def get(self, session_id: str) -> SessionView:
        return SessionView.of(await self._control.get(session_id, tenant=self.tenant))

    async def wait(self, session_id: str, *, timeout_s: float = 3600) -> SessionView:
        snapshot = await self._control.wait(session_id, timeout_s=timeout_s, tenant=self.tenant)
        return SessionView.of(snapshot)

    async def cancel(self, session_id: str) -> SessionView:
        await self._control.cancel(session_id, tenant=self.tenant)
        return await self.get(session_id)

    async def send_event(
        self,
        session_id: str,
        *,
        event_id: str,
        type: str,
        data: JsonValue,
        correlation_id: str | None = None,
        business_key: str | None = None,
        source: str = "client",
    ) -> bool:
        """Deliver an answer from the driver (e.g. a human decision taken in a notebook).
        Same gates as a webhook; a redelivery of ``event_id`` is a no-op."""
        snapshot = await self._control.get(session_id, tenant=self.tenant)
        wait = next(
            (
                w
                for w in snapshot.waits
                if (correlation_id and w.correlation_id == correlation_id)
                or (business_key and w.business_key == business_key)
            ),
            None,
        )
        return await self._control.deliver(
            InboxEvent.new(
                kind=EventKind.CALLBACK,
                session_id=session_id,
                source=source,
                event_id=event_id,
                type=type,
                received_at=self._services.clock.now(),
                correlation_id=correlation_id or (wait.correlation_id if wait else None),
                business_key=business_key,
                epoch=wait.epoch if wait else None,
                step_id=wait.waiting_step_id if wait else None,
                data=data,
                verified_by="client",
            )
        )

    async def submit_batch(
        self,
        agent: str,
        documents: list[JsonValue],
        *,
        metadata: dict[str, str] | None = None,
        batch_id: str | None = None,
        max_running: int | None = None,
    ) -> str:
        manifest = await self._batches.submit(
            tenant=self.tenant,
            agent=agent,
            documents=documents,
            metadata=metadata,
            batch_id=batch_id,
            max_running=max_running,
        )
        return manifest.batch_id

    async def submit_dataset(
        self,
        ds: Any,
        *,
        agent: str,
        by_reference: bool = False,
        metadata: dict[str, str] | None = None,
        max_running: int | None = None,
        batch_id: str | None = None,
    ) -> str:
        """A batch of one session per row of the ``ray.data.Dataset`` ``ds``.

        ``by_reference``: each row is stored once in the object store and the session's
        input is ``{"id": ..., "document_ref": key}`` (read it with ``read_document``), so
        large documents are not copied into every snapshot of the session.

        ``batch_id``: the batch's id, chosen by the caller (``torpor.ids.new_batch_id()``,
        kept where a rerun finds it): a driver run again after a crash then finds the
        batch it submitted, and no row is processed twice; without it every call is a new
        batch."""
        from torpor.ids import new_batch_id

        rows = [plain(row) for row in ds.iter_rows()]
        batch_id = batch_id or new_batch_id()
        documents: list[JsonValue] = list(rows)
        if by_reference:
            # A batch refused for what it names stores nothing: checked before the rows.
            self._batches.ensure_acceptable(agent, rows, metadata)
            # The rows are stored before the batch is accepted: noted first, so those of
            # a batch that never gets its manifest (a driver that died) go in time.
            await self._services.batches.mark_accepting(batch_id, self._services.clock.now())
            documents = []
            for i, row in enumerate(rows):
                key = await self._services.batches.put_document(batch_id, i, row)
                doc_id = row.get("id") if isinstance(row, dict) else None
                documents.append({"id": doc_id, DOCUMENT_REF: key})
        return await self.submit_batch(
            agent, documents, metadata=metadata, batch_id=batch_id, max_running=max_running
        )

    async def read_document(self, ref: str) -> JsonValue:
        """A document passed by reference (``submit_dataset(..., by_reference=True)``)."""
        return await self._services.batches.document(ref)

    async def results(self, batch_id: str, fmt: str = "jsonl") -> bytes:
        """The finished batch's results export (``BatchNotFinished`` before)."""
        return await self._batches.results(batch_id, fmt, tenant=self.tenant)

    async def read_results(self, batch_id: str, *, timeout_s: float | None = None) -> Any:
        """The batch's results as a ``ray.data.Dataset``, one row per document (index,
        document_id, session_id, state, result as JSON text, error); waits up to
        ``timeout_s`` for the batch to finish first if given."""
        import io

        import pyarrow.parquet as pq
        import ray.data

        if timeout_s is not None:
            await self.wait_batch(batch_id, timeout_s=timeout_s, interval_s=0.5)
        table = pq.read_table(io.BytesIO(await self.results(batch_id, "parquet")))
        return ray.data.from_arrow(table)

    async def progress(self, batch_id: str) -> dict[str, Any]:
        p = await self._batches.progress(batch_id, tenant=self.tenant)
        return {
            "batch_id": p.batch_id,
            "total": p.total,
            "done": p.done,
            "by_state": p.by_state,
        }

    async def wait_batch(
        self,
        batch_id: str,
        *,
        timeout_s: float = 24 * 3600,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        interval_s: float = 1.0,
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: dict[str, Any] | None = None
        while True:
            progress = await self.progress(batch_id)
            if on_progress is not None and progress != last:
                on_progress(progress)
            last = progress
            if progress["done"] == progress["total"]:
                return progress
            if loop.time() >= deadline:
                raise TimeoutError(f"batch {batch_id}: {progress['done']}/{progress['total']}")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await self._control.drain()
        await self._activator.close()  # its standby session actors, if it started any
        await self._services.close()


class Client:
    """Blocking facade over ``AsyncClient``; its event loop runs in a private thread."""

    def __init__(self, settings: Settings | None = None, **kwargs: Any) -> None:
        # Here, not on the private loop's thread: Ray sets its SIGTERM handler (exit, so
        # that ``ray.shutdown`` runs and a local Ray this started stops with it) only in
        # the main thread, and warned on every Client it was not set. The settings are
        # handed on as given: read from the environment by the client, they are passed
        # to the actors as their file's path, not their secrets (``AsyncClient``).
        given = inspect.signature(AsyncClient.connect).bind(settings, **kwargs)  # before Ray
        given.apply_defaults()
        checked_tenant(given.arguments["tenant"])
        _init_ray(settings or Settings.from_env(), kwargs.get("address"))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._async: AsyncClient = self._call(self._make(settings, kwargs))

    async def _make(self, settings: Settings | None, kwargs: dict[str, Any]) -> AsyncClient:
        return await AsyncClient.connect(settings, **kwargs)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    def submit(self, agent: str, input: JsonValue, **kwargs: Any) -> str:
        return self._call(self._async.submit(agent, input, **kwargs))

    def get(self, session_id: str) -> SessionView:
        return self._call(self._async.get(session_id))

    def wait(self, session_id: str, *, timeout_s: float = 3600) -> SessionView:
        return self._call(self._async.wait(session_id, timeout_s=timeout_s))

    def cancel(self, session_id: str) -> SessionView:
        return self._call(self._async.cancel(session_id))

    def send_event(self, session_id: str, **kwargs: Any) -> bool:
        return self._call(self._async.send_event(session_id, **kwargs))

    def submit_batch(self, agent: str, documents: list[JsonValue], **kwargs: Any) -> str:
        return self._call(self._async.submit_batch(agent, documents, **kwargs))

    def progress(self, batch_id: str) -> dict[str, Any]:
        return self._call(self._async.progress(batch_id))

    def wait_batch(self, batch_id: str, **kwargs: Any) -> dict[str, Any]:
        return self._call(self._async.wait_batch(batch_id, **kwargs))

    def submit_dataset(self, ds: Any, *, agent: str, **kwargs: Any) -> str:
        return self._call(self._async.submit_dataset(ds, agent=agent, **kwargs))

    def read_document(self, ref: str) -> JsonValue:
        return self._call(self._async.read_document(ref))

    def results(self, batch_id: str, fmt: str = "jsonl") -> bytes:
        return self._call(self._async.results(batch_id, fmt))

    def read_results(self, batch_id: str, *, timeout_s: float | None = None) -> Any:
        return self._call(self._async.read_results(batch_id, timeout_s=timeout_s))

    def close(self) -> None:
        self._call(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
