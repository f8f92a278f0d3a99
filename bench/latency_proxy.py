"""A TCP proxy that adds a fixed delay each way: a remote service's round trip, for a
bench run against a server on this machine (the S3 test server: a real S3 bucket is
10-50 ms away, not 0.1).

    with LatencyProxy("127.0.0.1", 9000, rtt_ms=20) as proxy:
        ...  # connect to proxy.port

Each chunk read from one side is written to the other ``rtt_ms / 2`` after it arrived,
in order (a pipe per direction, a queue between its reader and its writer), so a
request and its answer cost one round trip more, whatever their size.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import TracebackType


class LatencyProxy:
    def __init__(self, host: str, port: int, *, rtt_ms: float) -> None:
        self.target = (host, port)
        self.delay_s = rtt_ms / 2000
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = int(sock.getsockname()[1])
        sock.close()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", self.port)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            self._pipe(client_r, server_w), self._pipe(server_r, client_w), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(chunk)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.close()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
        finally:
            queue.put_nowait((0.0, b""))
            await delivering
