"""Commands sent while others are on the wire go out together, in one pipeline.

A webhook makes two Redis calls on its way to the 202 (its admission, then its wake
timer). Under load the replica's event loop is the bottleneck, and redis-py spends most
of a call's CPU on the call itself (a connection from the pool and back, packing, a
reader loop): 0.19-0.25 ms of CPU a call, against 0.04-0.06 ms a command in a pipeline
of 8-16 (``bench`` figures in the README). So hot-path commands are queued: the first
one goes at once, alone, written from its caller's own frame before the caller yields;
those that arrive while it is out wait for it and then leave together, in one
non-transactional pipeline. One call at a time (a webhook with nothing else in flight)
pays nothing for this.

The batch goes out over a lean connection of this module's own (``wire``): one write,
replies parsed as they arrive, ~0.05 ms of CPU a command against redis-py's 0.12-0.15
for a lone call. Each reply is put in its caller's own future as it is parsed, so the
caller wakes on the next turn of the loop; the sender task only follows the batch to
its end (its deadline, and the next batch). A client that ``wire`` cannot stand in for
(TLS, a unix socket) keeps redis-py's call and pipeline, replies passed on by the task.

What a caller sees is unchanged: its own result, or its own error. A pipeline is not a
transaction: each command stands alone, as separate calls did, and one command's error
(a ``ResponseError``) is that command's only. A connection failure or a timeout fails
every command of the batch whose reply had not been read yet, each as it would have
failed alone (the caller's ``translate`` turns it into ``IndexUnavailable``); whether the
server applied a command is then as unknown as it was for a lone call that timed out.
A caller cancelled while its command waits for the next batch, or while the lean
connection its batch goes out on is being made, is not sent for at all (on redis-py's
path, only the first).
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError

from storage.redis_index.wire import WireConnection, Written, settings_of

# A pipeline's replies are read one after the other: past a few dozen commands a batch
# only delays the first caller's answer (the next batch forms meanwhile anyway).
MAX_BATCH = 64

_Queued = tuple[tuple[Any, ...], dict[str, Any], "asyncio.Future[Any]"]
# A batch written from its caller's frame: its callers, the connection, what was sent.
_Sent = tuple[list[_Queued], WireConnection, Written]


class _Loop:
    """One event loop's part of a client: its queue, its sender task, its lean
    connection (a socket belongs to the loop it was made on) and the batches written
    from callers' frames that the sender has not read yet (None: none)."""

    __slots__ = ("queue", "sender", "wire", "written")

    def __init__(self) -> None:
        self.queue: list[_Queued] = []
        self.sender: asyncio.Task[None] | None = None
        self.wire: WireConnection | None = None
        self.written: list[_Sent] | None = None


class Pipelined:
    """``execute_command`` through a queue: commands that arrive while a batch is out are
    sent as the next batch, in the order they arrived."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        # A queue and a sender per event loop: a future is only ever resolved on its own
        # loop (a client used from one loop only, as redis-py's are, has one of each).
        # All a loop's parts in one entry: one lookup a call, not four (a resumed
        # webhook makes sixteen calls; ``bench/profile_gateway.py --instructions``).
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Loop] = (
            weakref.WeakKeyDictionary()
        )
        # None where the client's settings need redis-py (``wire.settings_of``).
        self._wire_settings = settings_of(client)
        self._closed = False  # a sender still draining must not connect again

    async def call(self, *args: Any, **options: Any) -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        parts = self._loops.get(loop)
        if parts is None:
            parts = self._loops[loop] = _Loop()
        queue = parts.queue
        queue.append((args, options, done))
        sender = parts.sender
        idle = sender is None or sender.done()
        written = parts.written
        if idle or written is not None:
            # Nothing out, or only what this turn of the loop wrote: the command leaves
            # now, from the caller's own frame, not from the sender task a turn later,
            # behind whatever the tasks ready before it do first (an activation's
            # snapshot load, started just before its lease is asked for). Commands of one
            # turn (a gather) still share one round trip: each is written as it comes,
            # before any reply is read. The task reads the replies. A lone round trip:
            # one turn of the loop fewer (epoll_wait 4.0 -> 3.2 a call, strace), 0.21-0.23
            # -> 0.16-0.19 ms p50 in quiet spells here (``bench/bench_round_trips.py``).
            sent = self._write_now(parts)
            if sent is not None and written is not None:
                written.append(sent)
            elif sent is not None:
                parts.written = [sent]
        if idle:
            parts.sender = task = loop.create_task(self._send(parts))
            if parts.written is not None:  # batches it must read, even if cancelled unrun
                task.add_done_callback(functools.partial(self._abandon, parts))
        return await done

    def _write_now(self, parts: _Loop) -> _Sent | None:
        """The queue's next batch written on the lean connection at once, if it is up
        (else None: the sender connects, or takes redis-py's path, as before)."""
        wire, queue = parts.wire, parts.queue
        if self._closed or wire is None or not wire.usable:
            return None
        batch = [q for q in queue[:MAX_BATCH] if not q[2].done()]
        if not batch or any(options for _, options, _ in batch):
            return None
        try:
            written = wire.write([args for args, _, _ in batch], [done for _, _, done in batch])
        except Exception:  # the sender's own attempt reports it to every caller
            return None
        del queue[:MAX_BATCH]
        return batch, wire, written

    async def _send(self, parts: _Loop) -> None:
        # What callers wrote before this first step: from now on, commands queue.
        sent, parts.written = parts.written or [], None
        queue = parts.queue
        try:
            while sent:
                # Its own connection: ``close`` may have dropped this loop's meanwhile
                # (then the replies fail as the connection's close makes them).
                batch, wire, written = sent[0]
                await self._settle(batch, wire.collect(written), queue)
                del sent[0]
        finally:
            _drop(sent)  # cancelled part-way (the loop is closing): the rest go unread
        while queue:
            # A caller cancelled while it waited is not sent for: a lease taken, or any
            # script run, for a caller that is gone would outlive it.
            batch = [q for q in queue[:MAX_BATCH] if not q[2].done()]
            del queue[:MAX_BATCH]
            if batch:
                await self._settle(batch, self._execute(batch, parts), queue)

    def _abandon(self, parts: _Loop, sender: asyncio.Task[None]) -> None:
        """A sender cancelled before its first step (its loop is closing) never reads the
        batches written for it; a newer sender, if one started meanwhile, reads them."""
        if sender.cancelled() and parts.sender is sender:
            sent, parts.written = parts.written or [], None
            _drop(sent)

    @staticmethod
    async def _settle(
        batch: list[_Queued], replies: Coroutine[Any, Any, list[Any]], queue: list[_Queued]
    ) -> None:
        """Each caller of ``batch`` gets its own reply, or the failure of the whole."""
        try:
            results = await replies
        except BaseException as exc:
            # Cancelled (the loop is closing) or failed whole: nobody is left waiting.
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(
                        exc if isinstance(exc, Exception) else asyncio.CancelledError()
                    )
            if not isinstance(exc, Exception):
                for _, _, done in queue:
                    if not done.done():
                        done.cancel()
                queue.clear()
                raise
            return
        for (_, _, done), result in zip(batch, results, strict=True):
            if done.done():  # answered as its reply was read (lean wire), or cancelled
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)

    async def _execute(self, batch: list[_Queued], parts: _Loop) -> list[Any]:
        if self._wire_settings is not None and not any(options for _, options, _ in batch):
            if self._closed:
                raise RedisConnectionError("the index's connection is closed")
            wire = parts.wire
            if wire is None:
                wire = parts.wire = WireConnection(self._wire_settings)
            return await wire.execute(
                [args for args, _, _ in batch], [done for _, _, done in batch]
            )
        # An argument redis-py cannot encode (text its encoding cannot take, an int past
        # the digit limit) raised while the whole pipeline was packed, failing every
        # command of the batch, and a lone call's came out as a bare ``UnicodeEncodeError``
        # or ``ValueError``: refused here by the client's own encoder, that command alone,
        # as the ``DataError`` the lean wire refuses it with.
        encode = self._client.get_encoder().encode  # type: ignore[no-untyped-call]
        refused = [_refusal(args, encode) for args, _, _ in batch]
        sendable = [q for q, error in zip(batch, refused, strict=True) if error is None]
        sent = iter(await self._redis_py(sendable) if sendable else [])
        return [next(sent) if error is None else error for error in refused]

    async def _redis_py(self, batch: list[_Queued]) -> list[Any]:
        """``batch`` through redis-py (TLS, a unix socket, or options it must handle)."""
        if len(batch) == 1:
            [(args, options, _)] = batch
            try:
                return [await self._client.execute_command(*args, **options)]  # type: ignore[no-untyped-call]
            except aioredis.ResponseError as exc:  # that command's own error
                return [exc]
        async with self._client.pipeline(transaction=False) as pipe:
            for args, options, _ in batch:
                pipe.execute_command(*args, **options)
            results: list[Any] = await pipe.execute(raise_on_error=False)
            return results

    def close(self) -> None:
        """Close the lean connections (the client itself is its owner's to close)."""
        self._closed = True
        for parts in list(self._loops.values()):
            if parts.wire is not None:
                parts.wire.close()
                parts.wire = None


def _refusal(args: tuple[Any, ...], encode: Callable[[Any], Any]) -> DataError | None:
    """The ``DataError`` of a command whose arguments ``encode`` cannot take, else None."""
    try:
        for arg in args:
            encode(arg)
    except DataError as exc:
        return exc
    except ValueError as exc:
        return DataError(f"invalid Redis argument: {exc}"[:200])
    return None


def _drop(sent: list[_Sent]) -> None:
    """Batches written that nobody will read: their callers cancelled, their replies left
    to be dropped as they come, their deadlines disarmed (one would drop the connection).
    Their replies' futures are the callers' own (``_write_now`` writes ``into`` them)."""
    for batch, _, written in sent:
        if written.finished is not None:  # nobody awaits it: a failure would go unheard
            written.finished.cancel()
        if written.stalled is not None:
            written.stalled.cancel()
        for _, _, done in batch:
            done.cancel()
