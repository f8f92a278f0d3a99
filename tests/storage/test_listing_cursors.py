"""A walk of a large folder of the local store lists the folder once, not once per page
(``storage.cursors``): every key in order, less those removed meanwhile."""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from storage import cursors, keys
from storage.local_store import LocalObjectStore
from storage.snapshots import ObjectSnapshots
from tests.support.factories import NOW, snapshot
from torpor.errors import StorageUnavailable
from torpor.ports import ListPage


class Folder:
    """A folder's keys, and how often it was listed whole."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = set(keys)
        self.listings = 0

    def listed(self, prefix: str, after: str | None) -> list[str]:
        self.listings += 1
        return sorted(k for k in self.keys if k.startswith(prefix) and (after is None or k > after))

    def present(self, key: str) -> bool:
        return key in self.keys


def walk(
    kept: cursors.Cursors, folder: Folder, prefix: str, limit: int, between: Callable[[], None]
) -> Iterator[list[str]]:
    token: str | None = None
    while True:
        page, token = kept.page(prefix, token, limit, listed=folder.listed, present=folder.present)
        yield page
        if token is None:
            return
        between()


def keys_of(n: int) -> list[str]:
    return [f"live/s_{i:05d}" for i in range(n)]


def test_a_walk_of_a_large_folder_lists_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    folder = Folder([*keys_of(120), "other/x"])
    pages = list(walk(cursors.Cursors(), folder, "live/", 25, lambda: None))
    assert [k for page in pages for k in page] == keys_of(120)
    assert [len(p) for p in pages] == [25, 25, 25, 25, 20]
    assert folder.listings == 1


def test_a_small_folder_is_listed_again_for_every_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``MIN_KEYS`` nothing is kept: each page sees the folder as it is then (a key
    created ahead of the walk is listed)."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    folder = Folder(keys_of(40))
    ahead = "live/s_00035b"
    pages = list(walk(cursors.Cursors(), folder, "live/", 10, lambda: folder.keys.add(ahead)))
    assert folder.listings == 5
    assert [k for page in pages for k in page] == sorted([*keys_of(40), ahead])


def test_keys_removed_during_a_walk_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    folder = Folder(keys_of(100))
    gone = set(keys_of(100)[50:80:10])

    def remove_ahead() -> None:
        folder.keys -= gone

    seen = [k for page in walk(cursors.Cursors(), folder, "live/", 20, remove_ahead) for k in page]
    assert folder.listings == 1
    assert seen == [k for k in keys_of(100) if k not in gone]


def test_a_walk_that_comes_back_after_the_idle_limit_lists_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    now = [0.0]
    kept = cursors.Cursors(clock=lambda: now[0])
    folder = Folder(keys_of(100))

    def idle() -> None:
        now[0] += cursors.IDLE_S + 1

    seen = [k for page in walk(kept, folder, "live/", 30, idle) for k in page]
    assert seen == keys_of(100)
    assert folder.listings == 4, "every page listed again"


def test_at_most_max_kept_walks_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest let go first: that walk lists again, and still sees every key."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    monkeypatch.setattr(cursors, "MAX_KEPT", 2)
    kept = cursors.Cursors()
    folders = {p: Folder([f"{p}{i:05d}" for i in range(100)]) for p in ("a/", "b/", "c/")}
    tokens = {}
    for prefix, folder in folders.items():
        _, tokens[prefix] = kept.page(
            prefix, None, 10, listed=folder.listed, present=folder.present
        )
    assert len(kept._kept) == 2
    for prefix, folder in reversed(folders.items()):  # the kept ones first
        page, _ = kept.page(
            prefix, tokens[prefix], 10, listed=folder.listed, present=folder.present
        )
        assert page == [f"{prefix}{i:05d}" for i in range(10, 20)]
    assert [f.listings for f in folders.values()] == [2, 1, 1]


def test_a_listing_older_than_max_age_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """However busy the walk keeps it: a listing taken long ago is taken again."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 0)  # every rest kept, however short
    now = [0.0]
    kept = cursors.Cursors(clock=lambda: now[0])
    folder = Folder(keys_of(100))

    def a_while() -> None:
        now[0] += cursors.IDLE_S - 1  # never idle for long: old after six pages

    seen = [k for page in walk(kept, folder, "live/", 5, a_while) for k in page]
    assert seen == keys_of(100)
    assert folder.listings == 4, "at the first page, then at the 7th, 13th and 19th"


def test_an_older_listing_does_not_replace_a_newer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two walks of one prefix end a page on the same key: the one listed later stays,
    and the walk listed earlier goes on with it."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    now = [0.0]
    kept = cursors.Cursors(clock=lambda: now[0])
    folder = Folder(keys_of(100))
    old_rest = kept._take  # the first walk's listing, held while the second is taken
    first, token = kept.page("live/", None, 10, listed=folder.listed, present=folder.present)
    held = old_rest("live/", token)  # as if its next page were being served right now
    assert held is not None
    now[0] += 1
    folder.keys.add("live/s_00050b")
    second, _ = kept.page("live/", None, 10, listed=folder.listed, present=folder.present)
    assert second == first
    kept._keep("live/", token, held)  # the first walk's listing, put back: older
    page, _ = kept.page("live/", token, 100, listed=folder.listed, present=folder.present)
    assert "live/s_00050b" in page, "the newer listing was kept"


def test_keys_handed_out_are_let_go_as_a_long_walk_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    monkeypatch.setattr(cursors, "_COMPACT_AFTER", 40)
    kept = cursors.Cursors()
    folder = Folder(keys_of(100))
    sizes: list[int] = []

    def size() -> None:
        sizes.extend(len(r.keys) for r in kept._kept.values())

    seen = [k for page in walk(kept, folder, "live/", 10, size) for k in page]
    assert seen == keys_of(100)
    assert sizes[0] == 100 and min(sizes) < 60, sizes


def test_at_most_max_keys_are_kept_across_walks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    monkeypatch.setattr(cursors, "MAX_KEYS", 250)
    kept = cursors.Cursors()
    for prefix in ("a/", "b/", "c/"):
        folder = Folder([f"{prefix}{i:05d}" for i in range(100)])
        kept.page(prefix, None, 10, listed=folder.listed, present=folder.present)
    assert [p for p, _ in kept._kept] == ["b/", "c/"]


def test_the_local_store_walks_a_large_folder_with_one_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the store: a walk of the live markers reads the folder once; a marker
    removed meanwhile is not listed, one created meanwhile is not either. A plain
    listing of the same folder is fresh at every page."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 100)
    store = LocalObjectStore(str(tmp_path))
    live = tmp_path / "objects" / "live"
    live.mkdir(parents=True)
    for key in keys_of(500):
        (tmp_path / "objects" / key).touch()
    (live / "s_00150~").touch()  # a stray file no key may name: listed, never fatal
    reads: list[str] = []  # the live folder's, each time it is read whole
    real_scandir = os.scandir

    def counted(path: Any = ".") -> Any:
        if str(path) == str(live):
            reads.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", counted)

    async def through(pages: Callable[..., Awaitable[ListPage]], added: str) -> list[str]:
        seen: list[str] = []
        token: str | None = None
        while True:
            page = await pages("live/", start_after=token, limit=100)
            seen += page.keys
            if page.next_token is None:
                return seen
            token = page.next_token
            if len(seen) == 100:  # after the first page
                await store.delete("live/s_00499")
                await store.put(added, b"")

    walked = asyncio.run(through(store.walk, "live/s_00300b"))
    assert walked == sorted([*keys_of(499), "live/s_00150~"])
    assert reads == [str(live)]
    reads.clear()
    listed = asyncio.run(through(store.list, "live/s_00300c"))
    assert "live/s_00300c" in listed, "list: every page fresh"
    assert len(reads) >= 6, "list: the folder read again for every page (of six)"


def test_the_live_and_ended_walks_of_repair_walk_the_local_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ObjectSnapshots`` pages its markers through ``walk`` where the store has it, and
    through ``list`` (fresh at every page) where it has not."""
    store = LocalObjectStore(str(tmp_path))
    snapshots = ObjectSnapshots(store)
    made = [asyncio.run(snapshots.create(snapshot())).session_id for _ in range(3)]
    used: list[tuple[str, str]] = []
    real_walk, real_list = store.walk, store.list

    async def walked(prefix: str, **kwargs: Any) -> ListPage:
        used.append(("walk", prefix))
        return await real_walk(prefix, **kwargs)

    async def listed(prefix: str, **kwargs: Any) -> ListPage:
        used.append(("list", prefix))
        return await real_list(prefix, **kwargs)

    monkeypatch.setattr(store, "walk", walked)
    monkeypatch.setattr(store, "list", listed)

    async def live() -> list[str]:
        return [h.session_id async for h in snapshots.list_live(now=NOW)]

    assert sorted(asyncio.run(live())) == sorted(made)
    assert ("walk", keys.LIVE) in used and ("list", keys.LIVE) not in used


def test_a_walk_of_a_failing_disk_raises_rather_than_finding_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repair walks the live markers and then marks the index intact: a folder it could
    not read must not read as one holding no live session."""
    store = LocalObjectStore(str(tmp_path))
    asyncio.run(store.put("live/s_00001", b""))
    real = os.scandir
    folder = str(tmp_path / "objects" / "live")

    def failing(path: Any = ".") -> Any:
        if str(path) == folder:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", failing)
    with pytest.raises(StorageUnavailable):
        asyncio.run(store.walk("live/"))
    with pytest.raises(StorageUnavailable):
        asyncio.run(store.list("live/"))


def test_a_walk_not_kept_lets_go_of_an_older_listing_at_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An abandoned large walk left its listing at the key a later, smaller walk's first
    page ends on: the later walk must not go on with it (it would miss keys made before
    it began)."""
    monkeypatch.setattr(cursors, "MIN_KEYS", 50)
    now = [0.0]
    kept = cursors.Cursors(clock=lambda: now[0])
    folder = Folder(keys_of(100))
    _, token = kept.page("live/", None, 10, listed=folder.listed, present=folder.present)
    assert token == "live/s_00009" and len(kept._kept) == 1  # then abandoned
    now[0] += 30
    folder.keys -= set(keys_of(100)[40:])  # too few now for the later walk to be kept
    folder.keys.add("live/s_00030b")
    seen = [k for page in walk(kept, folder, "live/", 10, lambda: None) for k in page]
    assert "live/s_00030b" in seen
    assert seen == sorted(folder.keys)
