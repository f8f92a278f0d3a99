"""HEAD on every GET route (RFC 9110 9.3.2): the GET's status and headers, no body.

FastAPI routes answer only the methods they name, so a load balancer or uptime probe that
checks ``/healthz`` with HEAD was answered 405. The request goes on as a GET; its body is
dropped here. A streamed answer (the session's event stream, the console's live view)
stops once its headers are out: the answer is complete then, and the server answers the
app's next receive with ``http.disconnect`` (ASGI), as when a client leaves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class HeadAsGet:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.start":
                await send(message)
                # Complete with no body: the GET's own body, streamed or not, is dropped.
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, headers_only)
