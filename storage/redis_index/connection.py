"""What every role of the Redis index shares: one client, the key builder, typed errors.

Every multi-key change is one MULTI/EXEC or one Lua script, so a reader never sees half
of it. Logical time (deadlines, a wait's deadline + grace) is passed in by the caller;
Redis TTLs, always relative, only garbage-collect entries well after they stop mattering,
so a caller's clock may differ from the server's. Leases are the exception: who holds a
session is decided by the server's clock alone (``leases.py`` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import timedelta
from functools import partial, wraps
from typing import Any, ParamSpec, TypeVar, cast

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from storage.keys import RedisKeys
from storage.redis_index.pipelining import Pipelined
from torpor.errors import IndexUnavailable

# Every call is bounded: a paused or unreachable Redis raises IndexUnavailable after this
# long instead of hanging an activation (and its pool slot), a webhook or a sweep.
REDIS_TIMEOUT_S = 5.0

P = ParamSpec("P")
T = TypeVar("T")


def translate(
    fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Turn redis-py's connection and server errors into the domain's typed
    IndexUnavailable; an argument Redis cannot be sent stays redis-py's ``DataError``."""

    @wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        self = cast("RedisConnection", args[0])
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise IndexUnavailable(
                f"Redis index at {self.url} is not reachable ({type(exc).__name__})"
            ) from exc
        except DataError:
            # An argument no Redis takes (not text, bytes or a number; text that is not
            # UTF-8): the caller's bug, raised as it is (a 500), not an outage to retry.
            raise
        except RedisError as exc:
            raise IndexUnavailable(f"Redis index at {self.url} failed: {exc}") from exc

    return wrapper


class RedisConnection:
    """The state the role mixins share; ``RedisIndex`` composes them over one of these."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "tp:",
        buckets: int = 512,
        deadline_shards: int = 128,
        client: aioredis.Redis | None = None,
    ) -> None:
        self._url = url
        self.keys = RedisKeys(prefix, buckets=buckets, deadline_shards=deadline_shards)
        self._redis: aioredis.Redis = client or aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
        )
        self._scripts: dict[str, AsyncScript] = {}
        # The webhook path's commands (admission, wake timer): batched under load.
        self._pipelined = Pipelined(self._redis)

    @property
    def url(self) -> str:
        # Never show a password that may be in the URL: in its userinfo, or in its
        # query (redis-py reads ?password=), which is left out whole.
        scheme, _, rest = self._url.partition("://")
        rest, query, _ = rest.partition("?")
        return f"{scheme}://{rest.rpartition('@')[2]}{query and '?[redacted]'}"

    @property
    def client(self) -> aioredis.Redis:
        return self._redis

    def script(self, source: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        """The Lua script ``source`` as a call ``(keys=..., args=...)``: by SHA, in the
        next batch of the lean connection (``batched_script``). Every script of the index
        goes this way: a lease, a bind or a registry update is one of an activation's
        round trips, and redis-py's own script call costs three times the CPU."""
        return partial(self.batched_script, source)

    def ordered_script(self, source: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        """The Lua script ``source`` as a call ``(keys=..., args=...)`` that runs where it
        stands in its batch: by its source (EVAL), in the next batch of the lean
        connection. For a script whose caller counts on it running before the commands
        sent after it in the same turn (``release.let_go``'s lift, before the lease's
        release). By SHA, a server that forgot it (restarted, SCRIPT FLUSH) answers
        NOSCRIPT, and by the time ``batched_script`` has it loaded and run, the commands
        that followed it in the batch have run already. The source costs its bytes on
        the wire (under a kilobyte) and a SHA1 on the server: kept to such scripts."""
        return partial(self._evaluated, source)

    async def _evaluated(self, source: str, *, keys: list[str], args: list[Any]) -> Any:
        return await self._pipelined.call("EVAL", source, len(keys), *keys, *args)

    def _registered(self, source: str) -> AsyncScript:
        """The Lua script ``source``, registered on this client once (it runs by SHA)."""
        found = self._scripts.get(source)
        if found is None:
            found = self._scripts[source] = self._redis.register_script(source)
        return found

    async def batched_script(self, source: str, *, keys: list[str], args: list[Any]) -> Any:
        """The script ``source`` by SHA, in the next pipeline (``pipelining``). A server
        that does not know it (restarted, flushed) has it loaded by redis-py's own call."""
        script = self._registered(source)
        try:
            return await self._pipelined.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=keys, args=args)

    async def batched(self, *args: Any) -> Any:
        """One command, in the next pipeline (``pipelining``)."""
        return await self._pipelined.call(*args)


def text(value: bytes | str) -> str:
    # The client decodes responses; this only narrows redis-py's bytes | str annotations.
    return value.decode() if isinstance(value, bytes) else value


def opt_text(value: bytes | str | None) -> str | None:
    return None if value is None else text(value)


def texts(values: Any) -> list[str]:
    return [text(v) for v in values]


def ms(delta: timedelta) -> int:
    return max(1, int(delta.total_seconds() * 1000))
