"""Pick storage adapters by URL.

``file://PATH`` and ``sqlite://PATH`` are the embedded defaults (one host);
``s3://bucket/prefix`` and ``redis://…`` / ``rediss://…`` are for clusters.
``memory://`` keeps everything in the opening process (each call opens an empty one):
for unit tests that need neither a folder nor a service.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

from storage.local_store import LocalObjectStore
from storage.memory_index import MemoryIndex
from storage.memory_store import MemoryObjectStore
from storage.sqlite_index import SqliteIndex
from torpor.errors import ConfigError, EmbeddedBackendOnCluster
from torpor.ports import ActivationQueue, Index, ObjectStore, RunningSlots
from torpor.settings import Settings, resolve_secret, shown_url
from torpor.storage_urls import local_folder, scheme_lowered


def _sqlite_path(url: str) -> Path:
    # sqlite:///abs/path and sqlite://relative/path; called only on a ``sqlite://`` URL
    # (an object store's folder is ``storage_urls.local_folder``'s to read).
    rest = url.removeprefix("sqlite://")
    if not rest:
        raise ConfigError(f"sqlite URL {url!r} names no path")
    return Path(rest)


def open_object_store(settings: Settings) -> ObjectStore:
    url = settings.storage.object_store_url
    if url.startswith("s3://"):
        # boto3 costs ~100 ms to import: only processes that use S3 pay for it.
        from storage.s3_store import S3ObjectStore

        parsed = urlparse(url)
        s3 = settings.storage.s3
        secret = resolve_secret(s3.secret_access_key) if s3.secret_access_key else None
        return S3ObjectStore(
            parsed.netloc,
            parsed.path,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            access_key_id=s3.access_key_id,
            secret_access_key=secret,
        )
    if url.startswith("memory://"):
        return MemoryObjectStore()
    folder = local_folder(url)
    if folder is not None:
        if not folder:
            raise ConfigError(f"object store URL {shown_url(url)!r} names no path")
        return LocalObjectStore(Path(folder))
    raise ConfigError(f"object store URL {shown_url(url)!r}: use s3://bucket/prefix or file://path")


def index_url(settings: Settings) -> str:
    """The index's URL, an ``env:`` one resolved, its scheme and form checked (no I/O):
    what the configuration can refuse about the index, known before anything opens
    (``actors.wiring.open_services``: a pool host that retries its open opened and
    closed a store on each attempt while the secret was missing)."""
    written = settings.storage.index_url
    url = scheme_lowered(resolve_secret(written)) if written.startswith("env:") else written
    if url.startswith(_REDIS_SCHEMES):
        # The parser the index's client uses (``redis.asyncio.Redis.from_url``).
        from redis.asyncio.connection import parse_url

        try:
            parse_url(url)
            parsed = True
        except ValueError:  # its message may quote a part of the URL: the password
            parsed = False
        if not parsed:  # raised here, so no error carrying the URL travels with it
            raise _refused_index(written, url, "it does not parse as a Redis URL")
    elif url.startswith("sqlite://"):
        _sqlite_path(url)  # one naming no path is refused, and says so
    elif not url.startswith("memory://"):
        raise _refused_index(written, url, _SCHEMES_ACCEPTED)
    return url


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_SCHEMES_ACCEPTED = "use redis://host:port/db, rediss://, unix://, sqlite://path or memory://"


def _refused_index(written: str, url: str, why: str) -> ConfigError:
    """The refusal of an index URL, which may hold a password: it names the variable an
    ``env:`` one came from and the URL's scheme, never the rest (``shown_url`` hides the
    password of a well-formed URL only, and a refused one is often malformed: a
    variable holding the password alone, a colon missing)."""
    head, sep, _ = url.partition("://")
    scheme = (
        f"{head}://" if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,15}", head) else "no scheme"
    )
    source = f" from {written}" if written.startswith("env:") else ""
    return ConfigError(f"index URL{source} ({scheme}): {why}")


def open_index(settings: Settings, url: str | None = None) -> Index:
    """The index at ``url`` (``index_url``'s answer), or at the settings' own."""
    url = index_url(settings) if url is None else url
    if url.startswith(_REDIS_SCHEMES):
        from storage.redis_index import RedisIndex

        return RedisIndex(
            url,
            prefix=settings.storage.redis_prefix,
            buckets=settings.storage.index_buckets,
            deadline_shards=settings.storage.index_deadline_shards,
        )
    if url.startswith("sqlite://"):
        return SqliteIndex(_sqlite_path(url))
    if url.startswith("memory://"):
        return MemoryIndex()
    raise _refused_index(url, url, _SCHEMES_ACCEPTED)  # a URL given that did not come from there


def open_slots(settings: Settings, index: Index) -> RunningSlots | None:
    """The caps on RUNNING batch sessions, beside the index and on its connection; None
    on SQLite (batch sessions then run uncapped: embedded use is one small host)."""
    if isinstance(index, MemoryIndex):
        from storage.memory_slots import MemorySlots

        return MemorySlots()
    from storage.redis_index import RedisIndex

    if isinstance(index, RedisIndex):
        from storage.redis_index.slots import RedisSlots

        return RedisSlots(index.url, prefix=settings.storage.redis_prefix, client=index.client)
    return None


def open_activation_queue(index: Index) -> ActivationQueue | None:
    """Activation requests to pool hosts through the index's Redis, on its connection;
    None elsewhere (SQLite and memory: pool hosts are then called through Ray)."""
    from storage.redis_index import RedisIndex

    if isinstance(index, RedisIndex):
        from storage.redis_index.queue import RedisActivationQueue

        return RedisActivationQueue(index.url, prefix=index.keys.prefix, client=index.client)
    return None


def check_embedded_allowed(settings: Settings, *, alive_nodes: int) -> None:
    """The local folder and SQLite are only shared by processes on one host; memory
    storage by nobody, so never under Ray, which runs torpor in several processes."""
    index = settings.storage.index_url
    index_in_memory = settings.index_scheme() == "memory"
    if settings.storage.object_store_url.startswith("memory:") or index_in_memory:
        # An index URL resolved from its variable is named as written: ``env:NAME``.
        named = f" (from {index})" if index_in_memory and index.startswith("env:") else ""
        raise ConfigError(
            f"memory:// storage{named} lives in one process and Ray runs several: "
            "use it only in tests that run torpor in-process"
        )
    if alive_nodes > 1 and settings.embedded:
        raise EmbeddedBackendOnCluster(
            f"this Ray cluster has {alive_nodes} nodes, but torpor is configured with "
            f"embedded storage ({shown_url(settings.storage.object_store_url)}, "
            f"{shown_url(settings.storage.index_url)}), which only works on one host. Set "
            "TORPOR_STORAGE__OBJECT_STORE_URL=s3://bucket/prefix and "
            "TORPOR_STORAGE__INDEX_URL=redis://host:6379/0 (see README, Configuration)."
        )
