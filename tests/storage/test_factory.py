"""Adapters are chosen by URL; ``memory://`` gives each opener its own empty storage."""

from __future__ import annotations

from typing import Any

import pytest

from storage.factory import check_embedded_allowed, index_url, open_index, open_object_store
from storage.local_store import LocalObjectStore
from storage.memory_index import MemoryIndex
from storage.memory_store import MemoryObjectStore
from torpor.errors import ConfigError, ObjectNotFound
from torpor.settings import Settings
from torpor.storage_urls import local_folder

MEMORY = Settings.build({"storage": {"object_store_url": "memory://", "index_url": "memory://"}})


async def test_memory_urls_open_memory_adapters_each_empty() -> None:
    first, second = open_object_store(MEMORY), open_object_store(MEMORY)
    assert isinstance(first, MemoryObjectStore) and isinstance(second, MemoryObjectStore)
    await first.put_if_absent("k", b"x")
    with pytest.raises(ObjectNotFound):
        await second.get("k")
    index = open_index(MEMORY)
    assert isinstance(index, MemoryIndex)
    assert not await index.is_intact()


def test_memory_storage_is_refused_under_ray() -> None:
    with pytest.raises(ConfigError, match="one process"):
        check_embedded_allowed(MEMORY, alive_nodes=1)
    index_only = Settings.build(
        {"storage": {"object_store_url": "s3://b/p", "index_url": "memory://"}}
    )
    with pytest.raises(ConfigError, match="memory://"):
        check_embedded_allowed(index_only, alive_nodes=1)


@pytest.mark.parametrize(
    ("resolved", "refused"),
    [("sqlite:///tmp/index.db", "only works on one host"), ("memory://", "one process")],
    ids=["sqlite", "memory"],
)
def test_an_index_url_from_the_environment_is_refused_for_one_host_as_written_would_be(
    monkeypatch: pytest.MonkeyPatch, resolved: str, refused: str
) -> None:
    """``env:`` was read as a scheme of its own: SQLite or memory storage named through
    a variable passed the refusals, and a cluster of several nodes ran an index each."""
    monkeypatch.setenv("TORPOR_TEST_INDEX_URL", resolved)
    settings = Settings.build(
        {"storage": {"object_store_url": "s3://b/p", "index_url": "env:TORPOR_TEST_INDEX_URL"}}
    )
    assert settings.embedded is (resolved.startswith("sqlite"))
    with pytest.raises(ConfigError, match=refused):
        check_embedded_allowed(settings, alive_nodes=3)
    monkeypatch.delenv("TORPOR_TEST_INDEX_URL")  # not set here: the opening process refuses
    check_embedded_allowed(settings, alive_nodes=3)
    assert not settings.embedded and settings.index_scheme() is None


def test_embedded_refusal_does_not_show_the_index_password() -> None:
    # A file:// object store beside a Redis index with a password is still "embedded":
    # the refusal named both URLs as written, the password with them.
    settings = Settings.build(
        {
            "storage": {
                "object_store_url": "file:///tmp/objects",
                "index_url": "redis://torpor:hunter2-secret@redis.internal:6379/0",
            }
        }
    )
    with pytest.raises(ConfigError) as caught:
        check_embedded_allowed(settings, alive_nodes=3)
    assert "hunter2-secret" not in str(caught.value)
    assert "redis.internal:6379/0" in str(caught.value)


def test_unknown_index_scheme_does_not_show_the_resolved_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An `env:` index URL is resolved before its scheme is checked: a mistyped scheme
    # echoed the resolved URL, password and all, that the env: indirection kept out.
    monkeypatch.setenv("TORPOR_TEST_INDEX_URL", "reddis://:hunter2-secret@redis.internal:6379/0")
    settings = Settings.build({"storage": {"index_url": "env:TORPOR_TEST_INDEX_URL"}})
    with pytest.raises(ConfigError) as caught:
        open_index(settings)
    assert "hunter2-secret" not in str(caught.value)
    assert "reddis://" in str(caught.value)


@pytest.mark.parametrize(
    "resolved",
    [
        "hunter2-secret",
        "redis//:hunter2-secret@h:6379/0",
        "reddis:/:hunter2-secret@h/0",
        "redis://:hunter2-secret",
    ],
    ids=["the password alone", "a colon missing", "a slash missing", "the host missing"],
)
def test_a_malformed_index_url_from_the_environment_shows_none_of_itself(
    monkeypatch: pytest.MonkeyPatch, resolved: str
) -> None:
    """``shown_url`` hides the password of a well-formed URL only: a refused URL names
    the variable it came from, never its value."""
    monkeypatch.setenv("TORPOR_TEST_INDEX_URL", resolved)
    settings = Settings.build({"storage": {"index_url": "env:TORPOR_TEST_INDEX_URL"}})
    with pytest.raises(ConfigError) as caught:
        open_index(settings)
    assert "hunter2" not in str(caught.value)
    assert "env:TORPOR_TEST_INDEX_URL" in str(caught.value)
    # Nor in an error it carries: the parser's said "Port could not be cast to integer
    # value as 'hunter2-secret'" (a traceback hides it; a walk of the chain does not).
    assert caught.value.__context__ is None and caught.value.__cause__ is None


async def test_a_redis_index_url_shows_no_password_held_in_its_query() -> None:
    # redis-py reads ?password= as the password; the index's url (in every
    # IndexUnavailable message: logs, CLI stderr) showed it.
    settings = Settings.build(
        {"storage": {"index_url": "redis://127.0.0.1:6379/0?password=hunter2-secret"}}
    )
    index = open_index(settings)
    try:
        assert "hunter2-secret" not in index.url
        assert index.url.startswith("redis://127.0.0.1:6379/0")
    finally:
        await index.close()


@pytest.mark.parametrize(
    ("written", "kind"),
    [("REDIS://127.0.0.1:6379/0", "RedisIndex"), ("SQLite://{tmp}/i.db", "SqliteIndex")],
    ids=["redis", "sqlite"],
)
async def test_an_index_url_whose_scheme_is_in_capitals_opens_as_in_lower_case(
    written: str, kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Schemes are case-insensitive (RFC 3986) and redis-py reads ``REDIS://`` as its
    own; the rest of the URL (a path, a password) is kept as written."""
    url = written.format(tmp=tmp_path)
    s3 = {"object_store_url": "s3://b/p"}
    written_in_settings = Settings.build({"storage": {**s3, "index_url": url}})
    monkeypatch.setenv("TORPOR_TEST_INDEX", url)
    from_env = Settings.build({"storage": {**s3, "index_url": "env:TORPOR_TEST_INDEX"}})
    for settings in (written_in_settings, from_env):
        lowered = index_url(settings)
        assert lowered.split("://")[1] == url.split("://")[1]
        index = open_index(settings, lowered)
        assert type(index).__name__ == kind
        await index.close()
        assert settings.index_scheme() == kind.removesuffix("Index").lower()
        assert settings.embedded is (kind == "SqliteIndex")


async def test_an_object_store_url_whose_scheme_is_in_capitals_is_not_taken_for_a_path(
    tmp_path: Any,
) -> None:
    """``FILE://`` was a bare path (a folder named ``FILE:``), ``S3://`` refused."""
    settings = Settings.build({"storage": {"object_store_url": f"FILE://{tmp_path}/objects"}})
    store = open_object_store(settings)
    assert isinstance(store, LocalObjectStore) and store.root == tmp_path / "objects"
    await store.close()
    assert settings.embedded
    s3 = Settings.build({"storage": {"object_store_url": "S3://b/p"}})
    assert s3.storage.object_store_url == "s3://b/p"


@pytest.mark.parametrize(
    "written",
    [
        "file://{tmp}/objects",
        "file:{tmp}/objects",
        "FILE:{tmp}/objects",
        "{tmp}/objects",
        "file://localhost{tmp}/objects",
        "file://LocalHost{tmp}/objects",
    ],
    ids=["file-slashes", "file-no-slashes", "file-capitals", "bare-path", "localhost", "Localhost"],
)
async def test_every_local_object_store_url_is_one_folder_and_counted_as_embedded(
    written: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings counted only ``file:`` URLs as embedded and the factory opened bare
    paths too: a bare path beside a Redis index passed the refusal on a cluster of
    several nodes. ``file:/abs`` was opened as a folder named ``file:`` here, and
    ``file://localhost/abs`` as a folder named ``localhost`` (RFC 8089: this host)."""
    monkeypatch.chdir(tmp_path)  # a URL misread as a relative folder lands here
    url = written.format(tmp=tmp_path)
    settings = Settings.build(
        {"storage": {"object_store_url": url, "index_url": "redis://127.0.0.1:6379/0"}}
    )
    assert settings.embedded
    with pytest.raises(ConfigError, match="only works on one host"):
        check_embedded_allowed(settings, alive_nodes=3)
    store = open_object_store(settings)
    assert isinstance(store, LocalObjectStore) and store.root == tmp_path / "objects"
    await store.close()


def test_an_object_store_url_of_no_local_folder_is_not_embedded() -> None:
    for url in ("s3://b/p", "memory://"):
        settings = Settings.build({"storage": {"object_store_url": url, "index_url": "memory://"}})
        assert settings.storage.object_store_url == url
        assert not Settings.build(
            {"storage": {"object_store_url": url, "index_url": "redis://h:6379/0"}}
        ).embedded
    for url in ("file://", "file://localhost"):  # not a folder named ``localhost`` here
        with pytest.raises(ConfigError, match="names no path"):
            open_object_store(Settings.build({"storage": {"object_store_url": url}}))


@pytest.mark.parametrize("url", ["memory:", "env:OBJECTS", "s3:bucket", "gs://b/p"])
def test_an_object_store_url_of_another_scheme_is_refused_not_opened_as_a_folder(
    url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read as a relative folder (``./env:OBJECTS``), such a URL opened an empty store in
    the working folder and counted as embedded storage."""
    monkeypatch.chdir(tmp_path)
    settings = Settings.build({"storage": {"object_store_url": url, "index_url": "memory://"}})
    assert local_folder(url) is None
    with pytest.raises(ConfigError, match="use s3://bucket/prefix or file://path"):
        open_object_store(settings)
    assert list(tmp_path.iterdir()) == []
