"""``memory://``: the index in one process's memory, for unit tests.

One module per role of the port, composed into ``MemoryIndex`` like the Redis and SQLite
adapters, with the same contract (it runs the same suite). Times are kept in whole
milliseconds, as the other indexes store them, and expiry is decided by the caller's
``now``. Every method finishes without yielding to the event loop, so each one is atomic
for the coroutines of that loop; nothing is shared with other processes.
"""

from storage.memory_index.claims import MemoryClaims
from storage.memory_index.health import MemoryHealth
from storage.memory_index.leases import MemoryLeases
from storage.memory_index.registry import MemorySessionRegistry
from storage.memory_index.timers import MemoryTimers


class MemoryIndex(MemoryClaims, MemoryTimers, MemoryLeases, MemorySessionRegistry, MemoryHealth):
    """The whole ``Index`` port in memory; a fresh instance holds nothing. (``MemoryClaims``
    carries the waits: admitting an event resolves its wait.)"""


__all__ = ["MemoryIndex"]
