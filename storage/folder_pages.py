"""A page of the keys in a folder tree, read in key order, visiting only what it needs.

The local folder store listed a prefix by walking every folder under it and sorting all
it found, whatever the page: retention asks, every sweep (5 s), for the first 100
ended markers, ``ended/{day}/{session}``, and so read every marker of every day kept (a
million sessions ended within the retention period: a million names a sweep). Folders
are visited in key order here, those wholly before ``start_after`` or outside the
prefix not at all, and the walk stops once the page is full: the first page of
``ended/`` reads the earliest day's folder. A flat folder is still read whole (a folder
cannot be read from a name onwards); a walk of one keeps its listing instead
(``storage.cursors``).

Key order is the order of the full key strings. Within a folder, an entry is ordered
by its name, and a folder's by its name and ``/``: the keys ``a.b`` < ``a/c`` < ``a0``
come out in that order although ``a`` sorts before ``a.b`` as a name.
"""

from __future__ import annotations

import contextlib
import os


class _Full(Exception):
    """The page holds one key more than asked for: the walk is over."""


def spelled_as_keys(folder: str) -> bool:
    """Whether ``folder`` could be the folder of a key: one spelled otherwise ("a//",
    "a/./b", "../.wal") names none, and as a path it may lead out of the objects."""
    return all(part not in ("", ".", "..") for part in folder.split("/"))


def page_of(
    root: str, prefix: str, start_after: str | None, limit: int
) -> tuple[list[str], str | None]:
    """The keys under ``prefix`` after ``start_after``, sorted, at most ``limit``, and the
    token for the next page (None at the end). ``root`` holds the keys as paths."""
    folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
    if folder and not spelled_as_keys(folder):
        return [], None
    found: list[str] = []

    def visit(path: str, rel: str) -> None:
        try:
            with os.scandir(path) as it:
                # A folder's name with its "/": plain strings sort in key order (a name
                # holds no "/"). As ``os.walk`` has it, a link to a folder is a folder,
                # never entered: left out.
                entries = sorted(
                    e.name if not e.is_dir() else e.name + "/"
                    for e in it
                    if not (e.is_symlink() and e.is_dir())
                )
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            key = f"{rel}/{entry}" if rel else entry
            if entry.endswith("/"):
                below = key  # every key in the folder starts with it
                if not (below.startswith(prefix) or prefix.startswith(below)):
                    continue  # outside the prefix
                if (
                    start_after is not None
                    and below < start_after
                    and not start_after.startswith(below)
                ):
                    continue  # every key below sorts before ``start_after``
                visit(f"{path}/{entry[:-1]}", key[:-1])
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                found.append(key)
                if len(found) > limit:
                    raise _Full

    with contextlib.suppress(_Full):
        visit(f"{root}/{folder}" if folder else root, folder)
    page = found[:limit]
    return page, page[-1] if len(found) > limit else None
