"""Hot-path Redis commands batched while others are out (``storage.redis_index.pipelining``),
on a real Redis: commands that arrive while one is on the wire leave together, in order;
each caller gets its own result or its own error; a lost server fails each command of
its batch promptly and typed; a script the server forgot is loaded again."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from storage.redis_index import RedisIndex
from storage.redis_index import leases as leases_module
from storage.redis_index.pipelining import MAX_BATCH, Pipelined
from tests.support.factories import snapshot
from tests.support.s3_server import free_port
from torpor.clock import SystemClock
from torpor.errors import IndexUnavailable
from torpor.lifecycle import SessionState
from torpor.ports import SessionEntry, TimerKind
from torpor.session.heartbeat import Heartbeat
from torpor.session.release import let_go
from torpor.session.runtime import lease_name

pytestmark = pytest.mark.redis


class Recorded(Pipelined):
    """Pipelined, noting the size of every batch it sends."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client)
        self.batches: list[int] = []

    async def _execute(self, batch: list[Any], parts: Any) -> list[Any]:
        self.batches.append(len(batch))
        return await super()._execute(batch, parts)

    def _write_now(self, parts: Any) -> Any:
        first = super()._write_now(parts)
        if first is not None:
            self.batches.append(len(first[0]))
        return first


@pytest.fixture
async def pipelined(client: aioredis.Redis) -> AsyncIterator[Recorded]:
    made = Recorded(client)
    yield made
    made.close()


async def test_commands_that_arrive_while_one_is_out_leave_together_in_order(
    pipelined: Recorded, redis_prefix: str
) -> None:
    key = f"{redis_prefix}counter"
    first = asyncio.ensure_future(pipelined.call("INCR", key))
    while not pipelined.batches:  # the first is on the wire, alone
        await asyncio.sleep(0)
    rest = await asyncio.gather(*(pipelined.call("INCR", key) for _ in range(19)))
    assert await first == 1
    assert rest == list(range(2, 21))  # each its own answer, in arrival order
    assert pipelined.batches == [1, 19]  # the rest waited, then went in one round trip
    # One at a time, nothing waits for anything: each goes alone, as a plain call.
    assert await pipelined.call("GET", key) == "20"
    assert pipelined.batches[-1] == 1


async def test_a_batch_is_never_larger_than_its_cap(pipelined: Recorded, redis_prefix: str) -> None:
    key = f"{redis_prefix}big"
    n = 2 * MAX_BATCH + 5
    results = await asyncio.gather(*(pipelined.call("RPUSH", key, i) for i in range(n)))
    assert results == list(range(1, n + 1))
    assert max(pipelined.batches) == MAX_BATCH and sum(pipelined.batches) == n


async def test_one_commands_error_is_its_own(
    client: aioredis.Redis, pipelined: Recorded, redis_prefix: str
) -> None:
    text, counter = f"{redis_prefix}text", f"{redis_prefix}n"
    await client.set(text, "not a number")
    calls = [
        pipelined.call("INCR", counter),
        pipelined.call("INCR", counter),
        pipelined.call("INCR", text),  # WRONGTYPE-style error, for this command only
        pipelined.call("INCR", counter),
    ]
    first, second, bad, last = await asyncio.gather(*calls, return_exceptions=True)
    assert pipelined.batches == [4]  # the error was inside a pipeline
    assert (first, second, last) == (1, 2, 3)
    assert isinstance(bad, ResponseError)
    assert await client.get(text) == "not a number"


async def test_a_caller_cancelled_while_queued_is_not_sent_and_the_others_get_theirs(
    pipelined: Recorded, redis_prefix: str
) -> None:
    key = f"{redis_prefix}c"
    calls = [asyncio.ensure_future(pipelined.call("INCR", key)) for _ in range(5)]
    await asyncio.sleep(0)  # all queued (the connection is not up yet: none left at once)
    calls[2].cancel()
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    # Cancelled while it waited for the next batch: never sent (a script run for a caller
    # that is gone, a lease taken say, would outlive it).
    assert [d for i, d in enumerate(done) if i != 2] == [1, 2, 3, 4]
    assert await pipelined.call("GET", key) == "4"


async def test_a_caller_cancelled_while_its_batch_connects_is_not_sent(
    pipelined: Recorded, client: aioredis.Redis, redis_prefix: str
) -> None:
    key = f"{redis_prefix}gone"
    call = asyncio.ensure_future(pipelined.call("SET", key, "1"))
    for _ in range(1000):  # bounded: the batch has left the queue and waits to connect
        if pipelined.batches:
            break
        await asyncio.sleep(0)
    assert pipelined.batches == [1]  # in ``_execute``, the lean connection not up yet
    call.cancel()
    # Its caller is gone before the batch is written: a lease taken, or a script run,
    # for nobody would outlive it. The next command leaves after it, on the same wire.
    await pipelined.call("PING")
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await client.exists(key) == 0


async def test_a_lone_command_leaves_before_its_caller_yields(pipelined: Recorded) -> None:
    """A task made ready before the command (an activation's snapshot read, started just
    before its lease is asked for) may block the loop; the command must already be on
    the wire by then: the server runs it meanwhile, not once the loop is free."""
    await pipelined.call("PING")  # the lean connection is up
    blocked: list[float] = []

    async def read_on_the_loop() -> None:
        blocked.append(time.time())
        time.sleep(0.3)  # the point: a loop blocked by a synchronous read
        blocked.append(time.time())

    reading = asyncio.ensure_future(read_on_the_loop())
    seconds, micros = await pipelined.call("TIME")
    await reading
    ran_at = int(seconds) + int(micros) / 1e6
    # One clock (this host's): the server ran it while the loop was blocked.
    assert ran_at < blocked[1] - 0.2, (ran_at, blocked)


async def test_a_caller_cancelled_after_its_command_left_leaves_the_connection_in_step(
    pipelined: Recorded, redis_prefix: str
) -> None:
    key = f"{redis_prefix}gone"
    await pipelined.call("PING")  # the lean connection is up: the next call leaves at once
    sent = asyncio.ensure_future(pipelined.call("INCR", key))
    await asyncio.sleep(0)  # written (its caller's first step), the reply not yet read
    sent.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sent
    # Its reply arrives and is dropped; every later caller still gets its own.
    assert await asyncio.gather(*(pipelined.call("INCR", key) for _ in range(3))) == [2, 3, 4]
    assert await pipelined.call("GET", key) == "4"


async def test_commands_of_one_turn_all_leave_before_any_reply_is_read(
    pipelined: Recorded, redis_prefix: str
) -> None:
    """With the connection up, commands asked for in one turn of the loop (a gather, as
    the activation queue's RPUSH and LTRIM) are each written as they come: none waits
    for another's reply, so together they still cost one round trip."""
    key = f"{redis_prefix}turn"
    await pipelined.call("PING")  # the lean connection is up
    before = len(pipelined.batches)
    assert await asyncio.gather(*(pipelined.call("INCR", key) for _ in range(3))) == [1, 2, 3]
    # Three writes from the callers' frames, no batch sent after a reply.
    assert pipelined.batches[before:] == [1, 1, 1]


def _reader_noted(pipelined: Pipelined, order: list[str]) -> None:
    """Note in ``order`` each time the task that collects a batch's replies has them."""
    wire = pipelined._loops[asyncio.get_running_loop()].wire
    collect = wire.collect

    async def noted(written: Any) -> list[Any]:
        out = await collect(written)
        order.append("reader")
        return out

    wire.collect = noted  # type: ignore[method-assign]


async def test_a_reply_reaches_its_caller_before_the_task_that_reads_it_runs(
    pipelined: Recorded,
) -> None:
    """The reply is put in the caller's own future as it is read: the caller resumes on
    the next turn of the loop, not a turn later, after the reading task passed it on."""
    await pipelined.call("PING")  # the lean connection is up: the next call leaves at once
    order: list[str] = []
    _reader_noted(pipelined, order)
    assert await pipelined.call("PING") == "PONG"
    order.append("caller")
    await pipelined._loops[asyncio.get_running_loop()].sender  # the reader is done too
    assert order == ["caller", "reader"]


async def test_a_reply_to_a_queued_batch_reaches_its_caller_before_its_reader_runs(
    pipelined: Recorded, redis_prefix: str
) -> None:
    """The same for a command that waited for the batch before it (sent by the task)."""
    key = f"{redis_prefix}queued"
    await pipelined.call("PING")
    order: list[str] = []
    _reader_noted(pipelined, order)
    # The first answers only after 0.2 s (nothing to pop): the second surely queues.
    first = asyncio.ensure_future(pipelined.call("BLPOP", f"{key}:empty", "0.2"))
    loop = asyncio.get_running_loop()
    for _ in range(10):  # on the wire, and its reader has started (it took the batch)
        await asyncio.sleep(0)
        if pipelined.batches[-1:] == [1] and pipelined._loops[loop].written is None:
            break
    assert pipelined._loops[loop].written is None
    sender = pipelined._loops[loop].sender

    async def caller() -> Any:
        got = await pipelined.call("INCR", key)
        order.append("caller")
        return got

    second = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    # Queued: it waits for the first's reply and leaves from the same reading task.
    assert not sender.done() and pipelined.batches[-1:] == [1] and len(pipelined.batches) == 2
    assert await second == 1
    assert await first is None
    await pipelined._loops[asyncio.get_running_loop()].sender  # the reader is done too
    assert pipelined.batches[-2:] == [1, 1]
    assert order == ["reader", "caller", "reader"]


async def test_a_sender_cancelled_before_it_ran_leaves_no_caller_waiting_and_no_deadline_armed(
    redis_url: str, redis_prefix: str
) -> None:
    """The loop closing cancels the task that would read a written command's reply
    before it ran: its caller is never left waiting (it has its reply, if the reply was
    read first, or is cancelled), and the batch's deadline is disarmed, since a deadline
    that fired later would drop the healthy connection and fail whatever is in flight
    then with a false timeout."""
    timeout_s = 0.3
    client = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s)
    pipelined = Pipelined(client)
    try:
        key = f"{redis_prefix}abandoned"
        await pipelined.call("PING")  # the lean connection is up: the next call leaves at once
        loop = asyncio.get_running_loop()
        wire = pipelined._loops[loop].wire
        call = asyncio.ensure_future(pipelined.call("INCR", key))
        await asyncio.sleep(0)  # written from its caller's frame; its reader not yet run
        [(_, _, written)] = pipelined._loops[loop].written
        assert written.stalled is not None  # its deadline, armed by the write
        pipelined._loops[loop].sender.cancel()  # as the loop's shutdown does
        # The reply, if it was read before the cancel, or the cancel: never a wait for ever.
        with contextlib.suppress(asyncio.CancelledError):
            assert await asyncio.wait_for(call, 5) == 1
        for _ in range(100):  # the cancelled reader's clean-up runs within a few turns
            if written.stalled.cancelled():
                break
            await asyncio.sleep(0)
        assert written.stalled.cancelled(), "the abandoned batch's deadline is still armed"
        assert wire.usable and pipelined._loops[loop].wire is wire  # not dropped by it
        assert await asyncio.wait_for(pipelined.call("GET", key), 5) == "1"  # it ran; in step
    finally:
        pipelined.close()
        await client.aclose()


async def test_a_close_right_after_a_lone_command_left_answers_its_caller(
    pipelined: Recorded,
) -> None:
    """Closed between the write from the caller's frame and the first step of the task
    that reads the reply: the caller gets the reply or the connection's failure, and
    never waits for ever."""
    await pipelined.call("PING")  # the lean connection is up: the next call leaves at once
    sent = asyncio.ensure_future(pipelined.call("PING"))
    await asyncio.sleep(0)  # written; the reader task is ready, not yet run
    pipelined.close()
    # The reply, or (the close came first) that caller's failure, typed.
    with contextlib.suppress(RedisConnectionError):
        assert await asyncio.wait_for(sent, 5) == "PONG"


async def test_a_server_that_is_gone_fails_every_command_of_the_batch_promptly() -> None:
    gone = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    pipelined = Recorded(gone)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(pipelined.call("PING") for _ in range(6)), return_exceptions=True),
            timeout=10,
        )
    finally:
        pipelined.close()
        await gone.aclose()
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    assert sum(pipelined.batches) == 6


async def test_the_index_reports_a_gone_server_as_unavailable_on_the_batched_path() -> None:
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", prefix="tptest:gone:")
    now = datetime.now(UTC)
    try:
        results = await asyncio.gather(
            *(
                index.admit(
                    claims=[("hook:s", f"d{i}")],
                    ttl=timedelta(minutes=15),
                    now=now,
                    tenant="t",
                    correlation_id=f"c{i}",
                    business_key=None,
                )
                for i in range(4)
            ),
            return_exceptions=True,
        )
    finally:
        await index.close()
    assert all(isinstance(r, IndexUnavailable) for r in results), results


async def test_a_script_the_server_forgot_is_loaded_again(
    redis_index: RedisIndex, client: aioredis.Redis
) -> None:
    now = datetime.now(UTC)

    async def admit(digest: str) -> bool:
        admission = await redis_index.admit(
            claims=[("hook:s", digest)],
            ttl=timedelta(minutes=15),
            now=now,
            tenant="t",
            correlation_id="c-1",
            business_key=None,
        )
        return admission.fresh

    assert await admit("d-1")
    await client.script_flush()  # a restarted or flushed server knows no scripts
    results = await asyncio.gather(admit("d-2"), admit("d-3"), admit("d-2"))
    assert sorted(results) == [False, True, True]  # still all-or-none claims, once each


async def held(redis_index: RedisIndex, sid: str, now: datetime) -> Heartbeat:
    """The session's lease, held by this test as an activation holds it."""
    lease = await redis_index.acquire_lease(
        name=lease_name(sid), owner="o", ttl=timedelta(minutes=1), now=now
    )
    assert lease is not None
    return Heartbeat(
        redis_index,
        lease,
        clock=SystemClock(),
        period=timedelta(seconds=10),
        ttl=timedelta(minutes=1),
    )


@pytest.mark.parametrize("reloaded", [False, True], ids=["flushed", "release-loaded-again"])
async def test_an_activations_lift_runs_before_its_release_on_a_server_that_forgot_scripts(
    redis_index: RedisIndex, client: aioredis.Redis, reloaded: bool
) -> None:
    """``let_go`` sends the lift of a quarantine first, the lease's release after it, in
    one batch: the lift counts on running while the lease is held (a holder since may
    have quarantined the session again). On a server that forgot its scripts (restarted,
    SCRIPT FLUSH; the release's own script loaded again since by another activation), a
    lift sent by SHA was answered NOSCRIPT and run again after the release. Seen in
    MONITOR: the lift's HSET of the state hash comes before the release's DEL."""
    s, sid, now = SessionState, "s_lift", datetime.now(UTC)
    await redis_index.record_session(
        tenant="acme", session_id=sid, state=s.QUARANTINED, generation=4
    )
    await redis_index.schedule(kind=TimerKind.WAKE, member=sid, at=now)
    heartbeat = await held(redis_index, sid, now)
    lease = heartbeat.lease
    restored = snapshot(session_id=sid, state=s.SUSPENDED).model_copy(update={"generation": 4})
    await client.script_flush()
    if reloaded:
        await client.script_load(leases_module._RELEASE)
    state_hash, lease_key = redis_index.keys.session_state, redis_index.keys.lease(lease.name)
    marker = f"{redis_index.keys.prefix}done"
    seen: list[str] = []
    async with client.monitor() as monitor:
        await let_go(redis_index, heartbeat, sid, unschedule=True, lift=restored)
        await client.echo(marker)
        while not (seen and seen[-1].startswith("ECHO") and marker in seen[-1]):
            seen.append((await asyncio.wait_for(monitor.next_command(), 5))["command"])
    lifted = [i for i, c in enumerate(seen) if c.startswith(f"HSET {state_hash} {sid} ")]
    released = [i for i, c in enumerate(seen) if c.startswith(f"DEL {lease_key}")]
    assert lifted and released, seen
    assert lifted[0] < released[0], seen
    assert await redis_index.session_entry(sid) == SessionEntry("acme", s.SUSPENDED, 4)
    assert await client.exists(lease_key) == 0


async def test_a_refused_lifts_read_of_the_quarantine_goes_between_it_and_the_release(
    redis_index: RedisIndex, client: aioredis.Redis
) -> None:
    """A lift refused by a newer QUARANTINED (a backup older than it restored) has
    ``let_go`` read the quarantine's generation: sent with the lift and the release, in
    their order (after the lift, before the lease's DEL: read while the lease was ours),
    over the same connection, and looking up no tenant (no SCAN, no ZSCORE). Read as a
    whole entry through redis-py, it went over a connection of its own, in no order with
    the two, and an older torpor's entry scanned the keyspace for its tenant."""
    s, sid, now = SessionState, "s_past", datetime.now(UTC)
    await redis_index.record_session(
        tenant="acme", session_id=sid, state=s.QUARANTINED, generation=6
    )
    heartbeat = await held(redis_index, sid, now)
    lease = heartbeat.lease
    restored = snapshot(session_id=sid, state=s.SUSPENDED).model_copy(update={"generation": 4})
    state_hash, lease_key = redis_index.keys.session_state, redis_index.keys.lease(lease.name)
    marker = f"{redis_index.keys.prefix}done"
    seen: list[dict[str, Any]] = []
    async with client.monitor() as monitor:
        await let_go(redis_index, heartbeat, sid, unschedule=True, lift=restored)
        await client.echo(marker)
        while not (seen and marker in seen[-1]["command"]):
            seen.append(await asyncio.wait_for(monitor.next_command(), 5))
    commands = [c["command"] for c in seen]
    sent = [i for i, c in enumerate(seen) if c["client_type"] != "lua"]  # by the clients
    lift = [i for i in sent if commands[i].startswith("EVAL ")]
    read = [i for i in sent if commands[i] == f"HGET {state_hash} {sid}"]
    released = [i for i, c in enumerate(commands) if c.startswith(f"DEL {lease_key}")]
    assert lift and read and released, commands
    assert lift[0] < read[0] < released[0], commands
    assert seen[lift[0]]["client_port"] == seen[read[0]]["client_port"], "one connection"
    assert not [c for c in commands if c.startswith(("SCAN", "ZSCORE"))], commands
    # Refused (the quarantine is newer), and nothing read the store to go further.
    assert await redis_index.session_entry(sid) == SessionEntry("acme", s.QUARANTINED, 6)
