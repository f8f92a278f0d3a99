"""The operator console served over real HTTP (uvicorn, no Ray: Ray is not the point
here), driven by headless Chromium (Debian's ``chromium``) through Playwright.

The server process half (the console, its services, sessions activated inline) runs on
its own event loop in a thread; the test half submits sessions and checks storage with
services of its own, on the same Redis prefix and object folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from playwright.async_api import Browser, Page, async_playwright

from actors.wiring import open_services, session_runtime
from storage.audit import ObjectAudit
from tests.runtime.approval_tools import approval_agent
from tests.runtime.test_gateway import SOURCES
from tests.support.harness import settings_for
from tests.support.s3_server import free_port
from tests.support.tools import agent_config
from torpor.auth import new_api_key
from torpor.entry.console import ConsoleDeps, ConsoleMount, ConsoleSlot
from torpor.ports.services import Services
from torpor.service.activator import InlineActivator
from torpor.service.deliveries import DeliveryWorker
from torpor.service.sessions import SessionService
from torpor.settings import Settings

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Console:
    url: str
    settings: Settings
    operator_key: str
    keys: dict[str, str]  # tenant -> API key
    # What the reconciler actor's ``status()`` answers (no Ray here): tests set it.
    reconciler: dict[str, Any]


def _serve(
    settings: Settings,
    port: int,
    ready: threading.Event,
    stop: list[Any],
    reconciler: dict[str, Any],
) -> None:
    mount = ConsoleMount(ConsoleSlot())  # its own: a server thread beside the tests

    async def status() -> dict[str, Any]:
        return reconciler

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        services = open_services(settings)
        runtime = session_runtime(services, "console-test")
        control = SessionService(
            services, InlineActivator(runtime, background=True), background=True
        )
        audit = services.audit if isinstance(services.audit, ObjectAudit) else None
        deps = ConsoleDeps(
            control, DeliveryWorker(services), audit, reconciler_status=status, live_tick_s=0.3
        )
        mount.bind(deps)
        yield
        await control.drain()
        await services.close()

    app = FastAPI(lifespan=lifespan)
    app.mount("/console", mount)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    stop.append(server)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        ready.set()
        await task

    asyncio.run(run())


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Console]:
    prefix = f"tpcon:{secrets.token_hex(4)}:"
    operator_key, operator_hash = new_api_key()
    acme_key, acme_hash = new_api_key()
    beta_key, beta_hash = new_api_key()
    settings = settings_for(
        tmp_path_factory.mktemp("console"),
        redis_url,
        prefix,
        extra={
            "security": {"operator_keys": [operator_hash]},
            "tenants": {"acme": {"api_keys": [acme_hash]}, "beta": {"api_keys": [beta_hash]}},
            "sources": SOURCES,
            "agents": {
                **agent_config(redis_url, prefix),
                # Its OA undo endpoint is down until the "undo-up" gate opens: dead letters.
                "undo": agent_config(redis_url, prefix, sla_s=60, compensate_gate="undo-up")[
                    "purchase"
                ],
                # An ApprovalTool asking "fd" (its OA is an in-process list): reassignment.
                "approval": approval_agent(stages=[{"approvers": ["fd"]}]),
            },
        },
    )
    port = free_port()
    ready, stop, reconciler = threading.Event(), [], {}
    thread = threading.Thread(
        target=_serve, args=(settings, port, ready, stop, reconciler), daemon=True
    )
    thread.start()
    assert ready.wait(30), "the console server did not start"
    yield Console(
        f"http://127.0.0.1:{port}/console",
        settings,
        operator_key,
        {"acme": acme_key, "beta": beta_key},
        reconciler,
    )
    stop[0].should_exit = True
    thread.join(30)
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
async def services(console: Console) -> AsyncIterator[Services]:
    svc = open_services(console.settings)
    yield svc
    await svc.close()


@pytest.fixture
async def control(services: Services) -> AsyncIterator[SessionService]:
    control = SessionService(services, InlineActivator(session_runtime(services, "test-driver")))
    yield control
    await control.drain()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        await chromium.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    page = await context.new_page()
    page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    yield page
    await context.close()


@pytest.fixture
async def operator(console: Console) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client signed in with the operator key (no browser: pages as text)."""
    async with httpx.AsyncClient(base_url=console.url, timeout=30) as client:
        form = csrf_of((await client.get("/login")).text)
        answer = await client.post("/login", data={"key": console.operator_key, "csrf": form})
        assert answer.status_code == 303
        yield client


def csrf_of(html: str) -> str:
    marker = 'name="csrf" value="'
    start = html.index(marker) + len(marker)
    return html[start : html.index('"', start)]


async def sign_in(page: Page, console: Console, key: str) -> None:
    await page.goto(console.url + "/")
    await page.fill("input[name=key]", key)
    await page.click("form[action$='/login'] button")
    await page.wait_for_url(console.url + "/")
