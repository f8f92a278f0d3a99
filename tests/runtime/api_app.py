"""The Serve app's FastAPI routes in this process, without Ray: the ``Ingress`` class's
routes bound to an instance built on the local store, a real Redis and the runtime
inline, and the console mounted on the same services, reached through httpx's ASGI
transport. The webhook fast path stays unbound: ``/v1/hooks`` is the FastAPI route."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

import serve_app
from actors.wiring import session_runtime
from tests.runtime.test_gateway import SOURCES
from tests.support.harness import Env, local_env
from torpor.auth import new_api_key
from torpor.entry.console import ConsoleDeps
from torpor.service.activator import InlineActivator
from torpor.service.batches import BatchService
from torpor.service.deliveries import DeliveryWorker
from torpor.service.gateway import WebhookGateway
from torpor.service.sessions import SessionService
from torpor.service.streams import SessionStreams


@dataclass
class App:
    env: Env
    http: httpx.AsyncClient
    keys: dict[str, str]  # tenant → bearer API key
    operator_key: str

    def auth(self, tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    async def console_login(self, key: str) -> str:
        """Sign in to the console with ``key`` (the client keeps the cookie); the login's
        CSRF token."""
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        token = csrf_in((await self.http.get("/console/login")).text)
        answer = await self.http.post(
            "/console/login", content=f"key={key}&csrf={token}", headers=form
        )
        assert answer.status_code == 303, answer.text
        return csrf_in((await self.http.get("/console/")).text)


def csrf_in(html: str) -> str:
    """The CSRF token of a console page's forms."""
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)


def _ingress_class() -> type:
    # ``serve.ingress`` subclasses the class it decorates; the routes call the original's
    # methods on whatever ``serve.get_replica_context().servable_object`` is.
    # Its ``__del__`` (Serve's shutdown hook, a coroutine) is not for this process.
    wrapper = serve_app.Ingress.func_or_class
    cls = next(c for c in wrapper.__mro__ if c.__name__ == "Ingress" and c is not wrapper)
    return type("InProcessIngress", (cls,), {"__del__": lambda self: None})


@asynccontextmanager
async def api_app(
    tmp: Path,
    redis_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    extra: dict[str, Any] | None = None,
) -> AsyncIterator[App]:
    acme_key, acme_hash = new_api_key()
    beta_key, beta_hash = new_api_key()
    operator_key, operator_hash = new_api_key()
    config = {
        "tenants": {"acme": {"api_keys": [acme_hash]}, "beta": {"api_keys": [beta_hash]}},
        "security": {"operator_keys": [operator_hash]},
        "sources": SOURCES,
        **(extra or {}),
    }
    async with local_env(tmp, redis_url, prefix, extra=config) as env:
        ingress: Any = object.__new__(_ingress_class())
        ingress.settings = env.services.settings
        ingress.services = env.services
        ingress.activator = None
        runtime = session_runtime(env.services, "test-runtime")
        ingress.control = SessionService(env.services, InlineActivator(runtime), background=True)
        ingress.batches = BatchService(ingress.control)
        ingress.gateway = WebhookGateway(ingress.control)
        ingress.streams = SessionStreams(ingress.control, max_per_tenant=4)
        ingress.deliveries = DeliveryWorker(env.services)
        ingress.reconciler = None
        context = SimpleNamespace(servable_object=ingress)
        monkeypatch.setattr("ray.serve.get_replica_context", lambda: context)
        serve_app.CONSOLE.bind(ConsoleDeps(ingress.control, ingress.deliveries))
        transport = httpx.ASGITransport(app=serve_app.api, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                yield App(env, http, {"acme": acme_key, "beta": beta_key}, operator_key)
            # The fan-outs first: a batch's answer left its fan-out running, and one cut
            # off by the services' close logged a failure no test made.
            await ingress.batches.drain()
            await ingress.control.drain()
        finally:
            serve_app.CONSOLE.unbind()  # unbound again: the module outlives this app
