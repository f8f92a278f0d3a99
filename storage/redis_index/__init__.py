"""``redis://``: the index for clusters, one module per role: redis-py asyncio, and for
every Lua script and the webhook path's commands a lean pipelined connection of our own
(``wire``, batched by ``pipelining``).

``RedisIndex`` is the roles composed over one client: waits, timers, claims, leases, the
session registry and health. Keys are built by ``storage.keys.RedisKeys``.
"""

from storage.redis_index.claims import RedisClaims
from storage.redis_index.health import RedisHealth
from storage.redis_index.leases import RedisLeases
from storage.redis_index.registry import RedisSessionRegistry
from storage.redis_index.timers import RedisTimers
from storage.redis_index.waits import RedisWaits


class RedisIndex(
    RedisWaits, RedisTimers, RedisClaims, RedisLeases, RedisSessionRegistry, RedisHealth
):
    """The whole ``Index`` port on Redis."""


__all__ = ["RedisIndex"]
