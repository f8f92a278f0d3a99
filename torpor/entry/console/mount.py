"""The console as an ASGI app that can be mounted before the services exist."""

# No ``from __future__ import annotations``: kept like the other FastAPI modules.
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from torpor.entry.console.app import ConsoleDeps, console_app


class ConsoleMount:
    """An ASGI app to mount before the services exist (at import time, as the Serve app
    does), bound to them later: answers 503 until :meth:`bind`."""

    def __init__(self) -> None:
        self._app: FastAPI | None = None

    def bind(self, deps: ConsoleDeps) -> None:
        self._app = console_app(deps)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            send = _no_sniffing(send)
        if self._app is None:
            response = Response("the console is starting", status_code=503)
            await response(scope, receive, send)
            return
        await self._app(scope, receive, send)


def _no_sniffing(send: Any) -> Any:
    """Every answer's type is the one it names (``nosniff``): a browser that guessed
    could run as a script or a page what the console served as text (a problem+json's
    detail, a session's payload echoed in an error)."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = [
                (k, v) for k, v in message.get("headers", []) if k != b"x-content-type-options"
            ]
            headers.append((b"x-content-type-options", b"nosniff"))
            message = {**message, "headers": headers}
        await send(message)

    return sending
