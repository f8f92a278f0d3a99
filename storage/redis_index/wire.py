"""A lean RESP2 connection for the webhook path's batched commands (``pipelining``).

redis-py spends 0.12-0.15 ms of CPU on a lone call (a connection from the pool and back,
packing through its encoder, its parser's reader loop); measured on this machine, the
same EVALSHA or ZADD through this connection costs ~0.05 ms, most of it the event loop's
own work. A batch is one ``write``; replies are parsed off the socket as they arrive and
handed out in order, since Redis answers a connection's commands in the order sent.

It speaks only what the hot path needs: plain TCP, RESP2, ``AUTH`` and ``SELECT`` from the
client's own settings. A client set up any other way (TLS, a unix socket, RESP3-only
options) keeps redis-py's path (:func:`settings_of` returns None). Replies are Redis's raw
values (no redis-py response callbacks), decoded as UTF-8 text (bytes that are not UTF-8
kept as surrogate escapes, never a failure of the whole batch). redis-py's own calls on
the same client may speak RESP3, where a Lua ``false`` comes back as ``False`` rather
than ``None``: callers test such replies for truth only.

Errors are redis-py's classes, so callers and ``connection.translate`` see what they saw
before: ``ResponseError`` (``NoScriptError`` for NOSCRIPT) for one command alone;
``ConnectionError`` for every command in flight when the connection cannot be made or is
lost; ``TimeoutError`` when replies stall past the deadline. A stalled connection is
dropped, never reused: replies are matched by position, so a late one would answer the
wrong caller. The next batch connects again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection as RedisTcpConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_CRLF = b"\r\n"


@dataclass(frozen=True)
class WireSettings:
    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    connect_timeout_s: float
    reply_timeout_s: float


def settings_of(client: aioredis.Redis) -> WireSettings | None:
    """The plain-TCP settings of ``client``'s pool, or None where redis-py must keep the
    connection (TLS, a unix socket, a custom connection class, credentials providers)."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    if pool.connection_class is not RedisTcpConnection or kwargs.get("credential_provider"):
        return None
    timeout = kwargs.get("socket_timeout") or 5.0
    return WireSettings(
        host=str(kwargs.get("host", "localhost")),
        port=int(kwargs.get("port", 6379)),
        db=int(kwargs.get("db", 0) or 0),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        connect_timeout_s=float(kwargs.get("socket_connect_timeout") or timeout),
        reply_timeout_s=float(timeout),
    )


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP2, its arguments encoded as redis-py's encoder does."""
    out = [b"*%d\r\n" % len(args)]
    try:
        for arg in args:
            # Text first, tested by its exact type: most arguments are (a commit's script
            # takes some thirty), and this is one test, where the chain below is up to four.
            data = arg.encode() if type(arg) is str else _encoded(arg)
            out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    except ValueError as exc:
        # Text that is not UTF-8 (a lone surrogate), an int past Python's digit limit:
        # this command's error alone (``write``), not one that fails its whole batch.
        raise DataError(f"invalid Redis argument: {exc}"[:200]) from None
    return b"".join(out)


def _encoded(arg: Any) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):  # a subclass of str (an enum's member)
        return arg.encode()
    if isinstance(arg, bool):  # before int: redis-py refuses bools too
        raise DataError(f"invalid Redis argument {arg!r}: convert it to bytes, str or a number")
    if isinstance(arg, int):
        return b"%d" % arg
    if isinstance(arg, float):
        return repr(arg).encode()
    raise DataError(f"invalid Redis argument of type {type(arg).__name__}")


def _error(line: str) -> ResponseError:
    code = line.split(" ", 1)[0]
    if code == "NOSCRIPT":
        return NoScriptError(line)
    return ResponseError(line)


def parse(buf: bytearray | bytes, pos: int) -> tuple[Any, int] | None:
    """One reply starting at ``pos``: (value, position after it), or None if incomplete.
    A ``-`` error reply is returned as its exception (the caller raises it for that
    command alone)."""
    end = buf.find(_CRLF, pos)
    if end < 0:
        return None
    kind = buf[pos]
    if kind == 0x2B:  # + simple string
        return bytes(buf[pos + 1 : end]).decode(errors="surrogateescape"), end + 2
    if kind == 0x3A:  # : integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 0x24:  # $ bulk string
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if len(buf) < stop + 2:
            return None
        return bytes(buf[end + 2 : stop]).decode(errors="surrogateescape"), stop + 2
    if kind == 0x2A:  # * array
        count = int(buf[pos + 1 : end])
        if count < 0:
            return None, end + 2
        items: list[Any] = []
        at = end + 2
        for _ in range(count):
            got = parse(buf, at)
            if got is None:
                return None
            item, at = got
            items.append(item)
        return items, at
    if kind == 0x2D:  # - error
        return _error(bytes(buf[pos + 1 : end]).decode(errors="replace")), end + 2
    raise RedisConnectionError(f"unexpected reply type {chr(kind)!r} from Redis")


class _Replies(asyncio.Protocol):
    """The socket's side: replies parsed as they arrive, handed out in send order.

    Each reply goes straight into the future that waits for it, which may be the caller's
    own (``WireConnection.write``'s ``into``): its caller wakes on the next turn of the
    loop, not one turn later behind a reader task that would pass it on. A batch's
    reader waits on the batch's own ``finished`` future instead, which no caller's
    cancellation can touch."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        # Per batch in flight, in send order: replies still due, and its finished future.
        self.batches: deque[list[Any]] = deque()
        self.buffer = bytearray()
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports (Ray Serve's loop) are not
        # asyncio.Transport subclasses, though they implement it.
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        pos = 0
        try:
            while pos < len(buffer):
                got = parse(buffer, pos)
                if got is None:
                    break
                value, pos = got
                if not self.waiting:
                    raise RedisConnectionError("Redis sent a reply nobody asked for")
                done = self.waiting.popleft()
                if not done.done():  # else its caller gave up (cancelled): dropped
                    if isinstance(value, ResponseError):
                        done.set_exception(value)
                    else:
                        done.set_result(value)
                batch = self.batches[0]
                batch[0] -= 1
                if batch[0] == 0:
                    self.batches.popleft()
                    if not batch[1].done():
                        batch[1].set_result(None)
        except (RedisConnectionError, ValueError) as exc:
            self.fail(RedisConnectionError(f"unreadable reply from Redis: {exc}"))
            return
        del buffer[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to Redis lost ({exc or 'closed'})"))

    def timed_out(self, after_s: float) -> None:
        """A batch's deadline passed with a reply still out: the connection is done."""
        self.fail(RedisTimeoutError(f"no reply from Redis within {after_s} s"))

    def fail(self, error: Exception) -> None:
        """Every command still waiting fails with ``error``; the connection is done."""
        if self.lost is None:
            self.lost = error
        while self.waiting:
            done = self.waiting.popleft()
            if not done.done():
                done.set_exception(error)
        while self.batches:
            finished = self.batches.popleft()[1]
            if not finished.done():
                finished.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


@dataclass(frozen=True)
class Written:
    """A batch on the wire: what was packed (a command that could not be is its error;
    None, one not sent because its caller was gone), the futures of the replies, the
    batch's own future (done once every reply is in, or failed with the connection), and
    the deadline's timer (None if nothing was sent)."""

    packed: list[bytes | DataError | None]
    answers: list[asyncio.Future[Any]]
    finished: asyncio.Future[None] | None
    stalled: asyncio.TimerHandle | None


class WireConnection:
    """One connection on one event loop. :meth:`execute` sends a batch in one write and
    returns each command's reply, or its error as a value; :meth:`write` and
    :meth:`collect` are its two halves, for a caller that sends before it yields."""

    def __init__(self, settings: WireSettings) -> None:
        self.settings = settings
        self._replies: _Replies | None = None

    @property
    def usable(self) -> bool:
        return self._replies is not None and self._replies.lost is None

    async def execute(
        self, commands: list[tuple[Any, ...]], into: list[asyncio.Future[Any]] | None = None
    ) -> list[Any]:
        if not self.usable:
            await self._connect()
        replies = self._replies
        assert replies is not None and replies.transport is not None
        if replies.lost is not None:  # dropped while it was being set up
            raise replies.lost
        return await self.collect(self.write(commands, into))

    def write(
        self, commands: list[tuple[Any, ...]], into: list[asyncio.Future[Any]] | None = None
    ) -> Written:
        """Send the batch now, on a connection that is up (``usable``): one write, with
        the replies' deadline armed. :meth:`collect` waits for them.

        ``into``: the callers' own futures, one per command, each then resolved with its
        reply (or its error) the moment the reply is read, with no hop through the task
        that collects. A command that cannot be encoded is not sent and its future is
        left alone: :meth:`collect` returns its error, for the caller's owner to hand on.
        A command whose future is done already (its caller was cancelled while the
        connection was being made) is not sent either: a lease taken, or a script run,
        for a caller that is gone would outlive it.
        """
        replies = self._replies
        assert replies is not None and replies.transport is not None
        loop = asyncio.get_running_loop()
        # A command that cannot be encoded is that caller's error alone, never sent.
        packed: list[bytes | DataError | None] = []
        answers: list[asyncio.Future[Any]] = []
        for i, args in enumerate(commands):
            if into is not None and into[i].done():
                packed.append(None)
                continue
            try:
                packed.append(pack(args))
            except DataError as exc:
                packed.append(exc)
                continue
            answers.append(into[i] if into is not None else loop.create_future())
        if not answers:
            return Written(packed, answers, None, None)
        finished: asyncio.Future[None] = loop.create_future()
        replies.waiting.extend(answers)
        replies.batches.append([len(answers), finished])
        replies.transport.write(b"".join(p for p in packed if isinstance(p, bytes)))
        # The error made only if the deadline passes: a batch's is rarely needed.
        stalled = loop.call_later(
            self.settings.reply_timeout_s, replies.timed_out, self.settings.reply_timeout_s
        )
        return Written(packed, answers, finished, stalled)

    async def collect(self, written: Written) -> list[Any]:
        """Each command's reply to a batch :meth:`write` sent, or its error as a value
        (None for one whose future was cancelled, sent or not: nobody is left to hand it
        to)."""
        packed, answers, finished = written.packed, written.answers, written.finished
        if finished is None:
            return list(packed)
        try:
            await finished
        except asyncio.CancelledError:
            # The sender was cancelled (its loop is closing): the replies still arrive in
            # order and are dropped, so the connection stays in step.
            for answer in answers:
                answer.cancel()
            raise
        except Exception:
            for answer in answers:  # each holds the same failure: retrieved, not logged
                if answer.done() and not answer.cancelled():
                    answer.exception()
            raise
        finally:
            if written.stalled is not None:
                written.stalled.cancel()
        out: list[Any] = []
        replied = iter(answers)
        for item in packed:
            if item is None or isinstance(item, DataError):
                out.append(item)
                continue
            answer = next(replied)
            if answer.cancelled():
                out.append(None)
                continue
            try:
                out.append(answer.result())
            except ResponseError as exc:
                out.append(exc)
        return out

    async def _connect(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        try:
            _, replies = await asyncio.wait_for(
                loop.create_connection(_Replies, s.host, s.port), s.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(
                f"cannot connect to Redis at {s.host}:{s.port} ({type(exc).__name__})"
            ) from exc
        self._replies = replies
        hello: list[tuple[Any, ...]] = []
        if s.password is not None:
            hello.append(("AUTH", s.username, s.password) if s.username else ("AUTH", s.password))
        if s.db:
            hello.append(("SELECT", s.db))
        if hello:
            for reply in await self.execute(hello):
                if isinstance(reply, Exception):
                    self.close()
                    raise RedisConnectionError(f"Redis refused the connection setup: {reply}")

    def close(self) -> None:
        if self._replies is not None and self._replies.transport is not None:
            self._replies.transport.close()
        self._replies = None
