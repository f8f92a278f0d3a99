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
import threading
import time
from types import TracebackType


class LatencyProxy:
    def __init__(self, host: str, port: int, *, rtt_ms: float) -> None:
        self.target = (host, port)
        self.delay_s = rtt_ms / 2000
        self.port = 0  # the listening port, once started
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="latency-proxy", daemon=True)

    def __enter__(self) -> LatencyProxy:
        self._thread.start()
        if not self._ready.wait(10) or not self.port:
            raise RuntimeError("the latency proxy did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            # Port 0: the kernel picks a free one, nothing else can take it meanwhile.
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0)
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
        finally:
            self._ready.set()
        self._loop.run_forever()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        server_w: asyncio.StreamWriter | None = None
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
            pipes = [
                asyncio.ensure_future(self._pipe(client_r, server_w)),
                asyncio.ensure_future(self._pipe(server_r, client_w)),
            ]
            try:  # both ends of stream passed on, or the first that failed
                await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
        except OSError:
            pass
        finally:
            self._connections.discard(task)
            for writer in (client_w, server_w):
                if writer is not None:
                    writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: each chunk written ``delay_s`` after it arrived, in order; the
        other side's end of stream passed on as a half close."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if not chunk:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(65536):
                if delivering.done():  # the other side went away: stop reading
                    break
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
            queue.put_nowait((time.monotonic() + self.delay_s, b""))
            await delivering
        finally:
            delivering.cancel()
