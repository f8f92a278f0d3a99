"""``open_services`` opens nothing it cannot hand back (no Ray: the real local store and
SQLite index on a temporary folder).

A pool host whose open fails retries it; the reconciler opens again in each sweep. Each
open that failed after the store or the index had opened left their files, SQLite
connection and worker thread for the garbage collector, and a secret missing from the
environment failed every retry that way.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from actors import wiring
from torpor.errors import ConfigError
from torpor.settings import Settings

UNSET = "TORPOR_TEST_SECRET_NOT_SET"


def local_settings(tmp_path: Path, **sections: dict[str, Any]) -> Settings:
    storage = {
        "object_store_url": f"file://{tmp_path / 'objects'}",
        "index_url": f"sqlite://{tmp_path / 'index.db'}",
    }
    storage.update(sections.pop("storage", {}))
    return Settings.build({"storage": storage, **sections})


class Opened:
    """The real openers, each part they open kept with the order its close came in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.parts: list[Any] = []
        self.closed: list[str] = []
        for name in ("open_object_store", "open_index", "open_slots", "open_activation_queue"):
            monkeypatch.setattr(wiring, name, self._spied(name, getattr(wiring, name)))

    def _spied(self, name: str, opener: Any) -> Any:
        def open_(*args: Any) -> Any:
            part = opener(*args)
            if part is None:  # nothing of the kind on this index (SQLite: no slots)
                return part
            self.parts.append(part)
            close = part.close

            async def closed() -> None:
                self.closed.append(name)
                await close()

            part.close = closed
            return part

        return open_


@pytest.mark.parametrize(
    ("sections", "refused"),
    [
        ({"security": {"capability_keys": [f"env:{UNSET}"]}}, UNSET),
        ({"security": {"audit_key": f"env:{UNSET}"}}, UNSET),
        ({"storage": {"index_url": f"env:{UNSET}"}}, UNSET),
        ({"storage": {"index_url": "reddis://127.0.0.1:6379/0"}}, "reddis://"),
        ({"storage": {"index_url": "redis://127.0.0.1:notaport/0"}}, "Redis URL"),
        ({"storage": {"index_url": "sqlite://"}}, "names no path"),
    ],
    ids=[
        "capability key",
        "audit key",
        "index URL's secret",
        "index URL's scheme",
        "Redis URL's port",
        "SQLite URL's path",
    ],
)
def test_what_the_configuration_refuses_is_refused_before_anything_opens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sections: dict[str, Any], refused: str
) -> None:
    monkeypatch.delenv(UNSET, raising=False)
    opened = Opened(monkeypatch)
    with pytest.raises(ConfigError, match=refused):
        wiring.open_services(local_settings(tmp_path, **sections))
    assert opened.parts == [], "the store or the index was opened for an open bound to fail"
    assert not (tmp_path / "objects").exists()


def test_an_index_that_cannot_open_closes_the_store_opened_before_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    opened = Opened(monkeypatch)
    (tmp_path / "a-folder").mkdir()  # where the index's database file should be
    settings = local_settings(tmp_path, storage={"index_url": f"sqlite://{tmp_path / 'a-folder'}"})
    with pytest.raises(ConfigError, match="cannot be opened"):
        wiring.open_services(settings)
    assert len(opened.parts) == 1, "the store was not opened: this measured nothing"
    assert opened.closed == ["open_object_store"]
    assert not opened.parts[0]._finalizer.alive, "the store's files are still open"


class Refused(RuntimeError):
    pass


def refuse(*_: Any) -> None:
    raise Refused("the part opened last cannot be made")


async def test_an_open_failing_on_an_event_loop_closes_what_it_opened_last_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a running loop (a pool host opens on its own): the closes are coroutines, and
    the loop they would be awaited on is the one the open is holding."""
    opened = Opened(monkeypatch)
    monkeypatch.setattr(wiring, "DeliveryNotifier", refuse)  # made after all of them
    with pytest.raises(Refused):
        wiring.open_services(local_settings(tmp_path))
    assert opened.closed == ["open_index", "open_object_store"]
    store, index = opened.parts
    assert not store._finalizer.alive, "the store's files are still open"
    assert index._conn is None, "the index's SQLite connection is still open"
    # Neither is owed to this loop: nothing was left on it to run.
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_an_open_on_redis_failing_closes_its_queue_slots_index_and_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The machine's Redis: the slots and the activation queue share the index's client,
    each with a connection of its own; every one is closed, the client by the index."""
    opened = Opened(monkeypatch)
    monkeypatch.setattr(wiring, "DeliveryNotifier", refuse)
    redis = {"index_url": "redis://127.0.0.1:6379/0", "redis_prefix": f"open-{os.getpid()}"}
    with pytest.raises(Refused):
        wiring.open_services(local_settings(tmp_path, storage=redis))
    assert opened.closed == [
        "open_activation_queue",
        "open_slots",
        "open_index",
        "open_object_store",
    ]
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_close_that_fails_leaves_the_others_closed_and_the_opens_error_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    opened = Opened(monkeypatch)
    monkeypatch.setattr(wiring, "DeliveryNotifier", refuse)
    real = wiring.open_index

    def failing_to_close(settings: Settings, url: str) -> Any:
        index = real(settings, url)  # the spy's: its close is recorded, then this one fails

        async def close() -> None:
            raise OSError("the index would not close")

        spied = index.close
        index.close = lambda: _then(spied(), close())
        return index

    monkeypatch.setattr(wiring, "open_index", failing_to_close)
    with pytest.raises(Refused):
        wiring.open_services(local_settings(tmp_path))
    assert opened.closed == ["open_index", "open_object_store"]
    assert not opened.parts[0]._finalizer.alive, "the store was left open"
    assert "could not close SqliteIndex after a failed open: OSError" in caplog.text


async def _then(first: Any, second: Any) -> None:
    try:
        await first
    finally:
        await second


async def test_an_open_failing_in_a_thread_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In ``opened_in_thread``'s thread (a replica, the client): no loop runs there."""
    opened = Opened(monkeypatch)
    monkeypatch.setattr(wiring, "DeliveryNotifier", refuse)
    with pytest.raises(Refused):
        await wiring.opened_in_thread(wiring.open_services, local_settings(tmp_path))
    assert opened.closed == ["open_index", "open_object_store"]


def test_an_open_that_succeeds_closes_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    opened = Opened(monkeypatch)
    services = wiring.open_services(local_settings(tmp_path))
    try:
        assert opened.closed == []
        assert opened.parts == [services.store, services.index]
    finally:
        asyncio.run(services.close())
