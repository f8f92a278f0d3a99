"""A page of the local folder store's keys, read in key order visiting only the folders
it needs (``storage.folder_pages``): the same pages as sorting every key under the
prefix, and far fewer folders read for the first page of a deep prefix."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.folder_pages import page_of
from storage.local_store import LocalObjectStore

NAMES = ["a", "a.b", "a-c", "a0", "b", "ab", "x_1", "x.1", "x", "20261201", "20261130"]


def tree(root: Path, seed: int, n: int = 300) -> list[str]:
    """Files at random paths of up to three levels, names chosen to sort unlike their
    folders (``a`` / ``a.b`` / ``a0``); every key made."""
    rng = random.Random(seed)
    keys: set[str] = set()
    while len(keys) < n:
        parts = [rng.choice(NAMES) for _ in range(rng.randint(1, 3))]
        key = "/".join(parts)
        # A key may not also be a folder of another key (a file cannot hold files).
        if any(k.startswith(key + "/") or key.startswith(k + "/") for k in keys):
            continue
        keys.add(key)
    for key in keys:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return sorted(keys)


def expected(keys: list[str], prefix: str, start_after: str | None, limit: int) -> list[str]:
    found = [k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after)]
    return found[:limit]


@pytest.mark.parametrize("seed", range(5))
def test_pages_are_those_of_every_key_sorted(tmp_path: Path, seed: int) -> None:
    keys = tree(tmp_path, seed)
    rng = random.Random(seed)
    prefixes = ["", "a", "a/", "a.", "a/a", "x", "x/", "2026", "20261201/", "b/a0/", "none/"]
    for prefix in prefixes:
        for limit in (1, 3, 7, 1000):
            # Walked page by page, as callers do, and from keys that are not there.
            token: str | None = None
            walked: list[str] = []
            while True:
                page, token = page_of(str(tmp_path), prefix, token, limit)
                assert page == expected(keys, prefix, walked[-1] if walked else None, limit)
                walked += page
                if token is None:
                    break
                assert token == page[-1]
            assert walked == expected(keys, prefix, None, len(keys))
            for start in [*rng.sample(keys, 5), "a/", "a.c", "x/zzz", "~"]:
                page, _ = page_of(str(tmp_path), prefix, start, limit)
                assert page == expected(keys, prefix, start, limit), (prefix, start, limit)


def test_the_first_page_of_a_deep_prefix_reads_only_the_folders_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's question every sweep: the first 100 ended markers, of thirty days
    kept. Only the earliest day's folder (and the one above it) is read."""
    store = LocalObjectStore(str(tmp_path))
    ended = tmp_path / "objects" / "ended"
    for day in range(1, 31):
        folder = ended / f"202611{day:02d}"
        folder.mkdir(parents=True)
        for i in range(150):
            (folder / f"s_{i:05d}").touch()
    read: list[str] = []
    real = os.scandir

    def scandir(path: str) -> Iterator[os.DirEntry[str]]:
        read.append(os.path.basename(path))
        return real(path)  # type: ignore[return-value]

    monkeypatch.setattr(os, "scandir", scandir)
    page = store._list("ended/", None, 100)
    assert page.keys == [f"ended/20261101/s_{i:05d}" for i in range(100)]
    assert read == ["ended", "20261101"]
    read.clear()
    later = store._list("ended/", page.keys[-1], 100)
    assert later.keys[-1] == "ended/20261102/s_00049"
    assert read == ["ended", "20261101", "20261102"], "the days before were not read"


@pytest.mark.parametrize("prefix", ["a//", "a/./", "./a/", "../", "a/../a/"])
def test_a_prefix_spelled_unlike_any_key_names_none(tmp_path: Path, prefix: str) -> None:
    """The old walk filtered such keys out by their spelling; one that walked the
    folder they name would hand out keys no read accepts (or files outside the store)."""
    (tmp_path / "objects" / "a").mkdir(parents=True)
    (tmp_path / "objects" / "a" / "x").touch()
    (tmp_path / "other").touch()
    assert page_of(str(tmp_path / "objects"), prefix, None, 10) == ([], None)
