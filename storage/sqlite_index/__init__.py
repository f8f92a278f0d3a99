"""``sqlite:///path``: the embedded index for one host, one module per role.

``SqliteIndex`` is the roles composed over one connection: waits, timers, claims, leases,
the session registry and health.
"""

from storage.sqlite_index.claims import SqliteClaims
from storage.sqlite_index.health import SqliteHealth
from storage.sqlite_index.leases import SqliteLeases
from storage.sqlite_index.registry import SqliteSessionRegistry
from storage.sqlite_index.timers import SqliteTimers
from storage.sqlite_index.waits import SqliteWaits


class SqliteIndex(
    SqliteWaits, SqliteTimers, SqliteClaims, SqliteLeases, SqliteSessionRegistry, SqliteHealth
):
    """The whole ``Index`` port on SQLite."""


__all__ = ["SqliteIndex"]
