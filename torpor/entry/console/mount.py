"""The console as an ASGI app that can be mounted before the services exist."""

# No ``from __future__ import annotations``: kept like the other FastAPI modules.
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from torpor.entry.console.app import ConsoleDeps, console_app


class ConsoleSlot:
    """Where a console app is bound once its services exist."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None


# The process's slot. Serve pickles the ingress's app to the replica (and freezes a copy
# of it when the class is decorated), so the mount the replica serves is a copy of the
# module's ``CONSOLE``: a slot the mount held would be a copy too, and which copy the
# replica's constructor bound depended on what the driver had pickled before (a driver
# that pickled the app once more, as a test did, served a console stuck at 503). Every
# copy of a mount without a slot of its own reads this module's, found by import.
SLOT = ConsoleSlot()


class ConsoleMount:
    """An ASGI app to mount before the services exist (at import time, as the Serve app
    does), bound to them later: answers 503 until :meth:`bind`. Mounts without a slot of
    their own share the process's one console: two apps in one process (Serve's local
    testing mode) serve the one bound last, as they share the webhook route."""

    def __init__(self, slot: ConsoleSlot | None = None) -> None:
        self.slot = slot  # None: the process's SLOT, looked up at each request

    def _slot(self) -> ConsoleSlot:
        return SLOT if self.slot is None else self.slot

    def bind(self, deps: ConsoleDeps) -> None:
        self._slot().app = console_app(deps)

    def unbind(self) -> None:
        self._slot().app = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            send = _no_sniffing(send)
        app = self._slot().app
        if app is None:
            response = Response("the console is starting", status_code=503)
            await response(scope, receive, send)
            return
        await app(scope, receive, send)


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
