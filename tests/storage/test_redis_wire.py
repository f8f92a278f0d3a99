"""The webhook path's lean Redis connection (``storage.redis_index.wire``), on a real Redis:
the same replies redis-py gives for the hot path's commands, replies split across reads,
credentials and database from the URL, and a stalled or lost server failing every command
in flight, typed, with the next call connecting again."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.redis_index.pipelining import Pipelined
from storage.redis_index.wire import WireConnection, pack, parse, settings_of
from tests.conftest import eventually

pytestmark = pytest.mark.redis

SCRIPT = "return {redis.call('TIME')[1], 1, false, {ARGV[1], 7}}"


@pytest.fixture
async def pipelined_client(client: aioredis.Redis) -> AsyncIterator[Pipelined]:
    made = Pipelined(client)
    yield made
    made.close()


@pytest.fixture
async def wire(client: aioredis.Redis) -> AsyncIterator[WireConnection]:
    settings = settings_of(client)
    assert settings is not None  # a plain redis:// URL is the lean path's
    made = WireConnection(settings)
    yield made
    made.close()


async def test_replies_are_what_redis_py_gives_for_the_hot_paths_commands(
    client: aioredis.Redis, wire: WireConnection, redis_prefix: str
) -> None:
    sha = await client.script_load(SCRIPT)
    zset, items = f"{redis_prefix}z", f"{redis_prefix}l"
    commands: list[tuple[object, ...]] = [
        ("EVALSHA", sha, 0, "é-unicode"),
        ("ZADD", zset, "LT", 1796000000000, "s_1"),
        ("ZADD", zset, "LT", 1796000000000, "s_1"),
        ("RPUSH", items, "a\tb\tc"),
        ("LTRIM", items, -100, -1),
        ("GET", f"{redis_prefix}missing"),
        ("ZSCORE", zset, "s_1"),
    ]
    got = await wire.execute(commands)
    await client.delete(zset, items)
    expected = [await client.execute_command(*c) for c in commands]  # type: ignore[no-untyped-call]
    # The script's nested array (its TIME differs), then the plain replies; LTRIM's
    # "OK" is the raw reply (redis-py's callback turns it into True).
    assert got[0][1:] == expected[0][1:] == [1, None, ["é-unicode", 7]]
    assert got[1:4] == expected[1:4] == [1, 0, 1]
    assert got[4] == "OK" and expected[4] is True
    assert got[5:] == [None, "1796000000000"]  # raw text (redis-py's callback: a float)
    assert expected[5:] == [None, 1796000000000.0]


async def test_an_error_is_its_own_commands_and_noscript_is_typed(
    client: aioredis.Redis, wire: WireConnection, redis_prefix: str
) -> None:
    text = f"{redis_prefix}text"
    await client.set(text, "not a number")
    got = await wire.execute(
        [("INCR", text), ("EVALSHA", "0" * 40, 0), ("INCR", f"{redis_prefix}n")]
    )
    assert isinstance(got[0], ResponseError) and not isinstance(got[0], NoScriptError)
    assert isinstance(got[1], NoScriptError)  # what batched_script reloads on
    assert got[2] == 1


def test_a_reply_split_anywhere_waits_for_the_rest() -> None:
    whole = b"*3\r\n$5\r\nhello\r\n:-42\r\n*2\r\n$-1\r\n+OK\r\n" + b"-ERR boom\r\n"
    for cut in range(35):
        # Incomplete until the first reply's last byte is in.
        first = parse(whole[:cut], 0)
        assert first is None, cut
    value, at = parse(whole, 0) or (None, 0)
    assert value == ["hello", -42, [None, "OK"]]
    error, end = parse(whole, at) or (None, 0)
    assert isinstance(error, ResponseError) and str(error) == "ERR boom" and end == len(whole)


def test_arguments_are_encoded_as_redis_py_encodes_them() -> None:
    assert pack(("SET", "k", 12, 1.5, b"\x00")) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$3\r\n1.5\r\n$1\r\n\x00\r\n"
    )
    with pytest.raises(Exception, match="invalid Redis argument"):
        pack(("SET", "k", True))


def test_every_kind_of_argument_packs_as_redis_pys_own_packer() -> None:
    """Text of every sort (an enum member, a str subclass, non-ASCII), bytes, integers
    of any size and sign, floats: byte for byte what redis-py would send."""
    from redis.connection import Encoder, PythonRespSerializer

    from torpor.lifecycle import SessionState

    class Name(str):
        pass

    args = (
        "EVALSHA",
        "é€",
        SessionState.RUNNING,
        Name("sub"),
        b"",
        b"\xff\x00",
        0,
        -7,
        2**70,
        0.1,
        -1e300,
        "",
    )
    ours = pack(args)
    theirs = b"".join(
        PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode).pack(*args)
    )
    assert ours == theirs
    for refused in (True, None, [1], 1 + 2j):
        with pytest.raises(DataError, match="invalid Redis argument"):
            pack(("SET", "k", refused))


async def test_the_database_named_in_the_url_is_the_one_written(
    redis_url: str, redis_prefix: str
) -> None:
    base = redis_url.rsplit("/", 1)[0]
    other = aioredis.Redis.from_url(f"{base}/3", decode_responses=True)
    first = aioredis.Redis.from_url(f"{base}/0", decode_responses=True)
    pipelined = Pipelined(other)
    key = f"{redis_prefix}db3"
    try:
        assert await pipelined.call("SET", key, "here") == "OK"
        assert await other.get(key) == "here"  # redis-py on db 3 sees it
        assert await first.get(key) is None
    finally:
        await other.delete(key)
        pipelined.close()
        await other.aclose()
        await first.aclose()


async def test_credentials_in_the_url_are_sent_and_wrong_ones_refused(
    client: aioredis.Redis, redis_url: str, redis_prefix: str
) -> None:
    user, password = f"tptest-{secrets.token_hex(4)}", secrets.token_hex(8)
    await client.execute_command(  # type: ignore[no-untyped-call]
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all"
    )
    host = redis_url.split("://", 1)[1].split("/", 1)[0]
    good = aioredis.Redis.from_url(f"redis://{user}:{password}@{host}/0", decode_responses=True)
    bad = aioredis.Redis.from_url(f"redis://{user}:wrong@{host}/0", decode_responses=True)
    pipelines = [Pipelined(good), Pipelined(bad)]
    try:
        assert await pipelines[0].call("ACL", "WHOAMI") == user
        with pytest.raises(RedisConnectionError, match="refused the connection setup"):
            await pipelines[1].call("PING")
    finally:
        for p in pipelines:
            p.close()
        await good.aclose()
        await bad.aclose()
        await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]


async def test_a_stalled_server_times_out_every_command_in_flight_and_is_dropped() -> None:
    connections: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stalled = aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=0.3)
    pipelined = Pipelined(stalled)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(pipelined.call("PING") for _ in range(5)), return_exceptions=True),
            timeout=10,
        )
        assert all(isinstance(r, RedisTimeoutError) for r in results), results
        # Never reused (a late reply would answer the wrong caller): the next call
        # connects again.
        again = await asyncio.gather(pipelined.call("PING"), return_exceptions=True)
        assert isinstance(again[0], RedisTimeoutError)
        assert len(connections) == 2
    finally:
        pipelined.close()
        await stalled.aclose()
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_connection_the_server_drops_fails_its_commands_and_the_next_reconnects(
    client: aioredis.Redis, redis_prefix: str
) -> None:
    pipelined = Pipelined(client)
    name = f"{redis_prefix}wire-{secrets.token_hex(3)}"
    try:
        assert await pipelined.call("CLIENT", "SETNAME", name) == "OK"
        listing = await client.client_list()
        [ours] = [c for c in listing if c.get("name") == name]
        # The server drops it while a blocking command is in flight on it.
        blocked = asyncio.ensure_future(pipelined.call("BLPOP", f"{redis_prefix}none", 3))

        async def in_flight() -> bool:
            clients = await client.client_list()
            return any(c.get("name") == name and c.get("cmd") == "blpop" for c in clients)

        await eventually(in_flight, what="the BLPOP is on the server")
        assert await client.client_kill_filter(_id=ours["id"]) == 1
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(blocked, timeout=2)
        assert await pipelined.call("PING") == "PONG"  # a new connection
    finally:
        pipelined.close()


def test_clients_the_lean_path_cannot_stand_in_for_keep_redis_py() -> None:
    unix = aioredis.Redis(unix_socket_path="/tmp/nowhere.sock")
    tls = aioredis.Redis.from_url("rediss://127.0.0.1:6380/0")
    assert settings_of(unix) is None
    assert settings_of(tls) is None
    plain = settings_of(aioredis.Redis.from_url("redis://u:p@127.0.0.1:6390/5"))
    assert plain is not None
    assert (plain.host, plain.port, plain.db, plain.username, plain.password) == (
        "127.0.0.1",
        6390,
        5,
        "u",
        "p",
    )


def test_it_runs_on_uvloop_as_in_a_serve_replica(redis_url: str, redis_prefix: str) -> None:
    # uvloop's transports are not asyncio.Transport subclasses; Serve replicas run on it.
    uvloop = pytest.importorskip("uvloop", reason="uvloop comes with ray[serve]")

    async def round_trip() -> list[object]:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        pipelined = Pipelined(client)
        try:
            return list(
                await asyncio.gather(
                    pipelined.call("SET", f"{redis_prefix}uv", "1"),
                    pipelined.call("INCR", f"{redis_prefix}uv"),
                )
            )
        finally:
            pipelined.close()
            await client.aclose()

    assert uvloop.run(round_trip()) == ["OK", 2]


@pytest.mark.parametrize("path", ["lean wire", "redis-py"])
@pytest.mark.parametrize(
    "unencodable",
    [object(), "lone \udc80 surrogate", 10**5000],
    ids=["object", "surrogate", "int-past-digit-limit"],
)
async def test_a_command_that_cannot_be_encoded_fails_alone(
    client: aioredis.Redis, redis_prefix: str, unencodable: object, path: str
) -> None:
    """Not an object Redis takes, text that is not UTF-8, an int Python will not print:
    that command's caller alone gets a ``DataError``; the batch's others are answered,
    and so is a batch where it goes out alone. On either path: redis-py's is a client
    the lean wire cannot stand in for (TLS, a unix socket), taken here over this
    machine's Redis by a client whose wire settings are none."""
    pipelined = Pipelined(client)
    assert pipelined._wire_settings is not None  # a plain redis:// URL: the lean wire's
    if path == "redis-py":
        pipelined._wire_settings = None
    key = f"{redis_prefix}enc"
    try:
        good, bad, other = await asyncio.gather(
            pipelined.call("INCR", key),
            pipelined.call("SET", key, unencodable),
            pipelined.call("INCR", key),
            return_exceptions=True,
        )
        alone = await asyncio.gather(
            pipelined.call("SET", key, unencodable), return_exceptions=True
        )
    finally:
        pipelined.close()
    assert (good, other) == (1, 2)
    assert isinstance(bad, DataError)
    assert isinstance(alone[0], DataError), alone


async def test_a_reply_that_is_not_utf8_fails_only_its_command(
    client: aioredis.Redis, pipelined_client: Pipelined, redis_prefix: str
) -> None:
    key = f"{redis_prefix}bin"
    await client.execute_command("SET", key, b"\xff\xfe")  # type: ignore[no-untyped-call]
    got, after = await asyncio.gather(
        pipelined_client.call("GET", key), pipelined_client.call("INCR", f"{redis_prefix}n")
    )
    assert got.encode(errors="surrogateescape") == b"\xff\xfe" and after == 1


async def test_an_argument_redis_cannot_take_is_the_callers_error_not_an_outage() -> None:
    """The index's calls (``translate``): a lost connection is ``IndexUnavailable`` (503,
    retried), a ``DataError`` stays itself (a 500, counted as the bug it is): no retry
    of a command that can never be sent."""
    from storage.redis_index.connection import translate
    from torpor.errors import IndexUnavailable

    class Index:
        url = "redis://127.0.0.1:6379/0"

        @translate
        async def unsendable(self) -> None:
            raise DataError("invalid Redis argument: 'utf-8' codec can't encode")

        @translate
        async def unreachable(self) -> None:
            raise RedisConnectionError("connection refused")

    with pytest.raises(DataError):
        await Index().unsendable()
    with pytest.raises(IndexUnavailable):
        await Index().unreachable()
