"""The rest of a long listing of the local folder store, kept for its next page.

A folder on disk cannot be read from a key onwards: every page of a listing read the
whole folder and sorted it again, so a walk of a large one cost its size once per page.
Repair walks the live markers, one per sleeping session, a page of 1,000 at a time:
127 ms a page at 100,000 markers here, about 22 minutes of listing alone at a million
(``bench/bench_listing.py``). The first page of a listing of more than ``MIN_KEYS`` keys
now keeps the sorted rest, found again by the key the page ended on (the token its
caller passes back as ``start_after``); each next page takes its share of it, checking
that each key is still there. So a walk shows the keys its first page found, less those
removed since, and not one created after its first page (a cursor's view, where S3
would show a key created after the cursor's position).

Kept for ``IDLE_S`` between pages at most, ``MAX_KEPT`` walks at once (the oldest let
go first): a walk that comes back later, or one of many at once, lists again.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MIN_KEYS = 10_000  # below this a page lists the folder again: a small folder is fresh
IDLE_S = 60.0
MAX_KEPT = 8


@dataclass
class _Rest:
    keys: list[str]  # sorted; those before ``at`` were handed out already
    at: int
    used_at: float


class Cursors:
    """Thread-safe: pages are listed in the store's worker threads."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], _Rest] = OrderedDict()

    def page(
        self,
        prefix: str,
        start_after: str | None,
        limit: int,
        *,
        listed: Callable[[], list[str]],
        present: Callable[[str], bool],
    ) -> tuple[list[str], str | None]:
        """The page of keys under ``prefix`` after ``start_after`` (and the token for the
        next, None at the end): from the rest a walk's earlier page kept, else from
        ``listed()`` (every key of the folder, in any order). ``present`` tells whether
        a kept key still names an object."""
        rest = self._take(prefix, start_after) if start_after is not None else None
        if rest is None:
            found = sorted(
                k
                for k in listed()
                if k.startswith(prefix) and (start_after is None or k > start_after)
            )
            rest = _Rest(found, 0, self._clock())
            fresh = True
        else:
            fresh = False
        page: list[str] = []
        while rest.at < len(rest.keys) and len(page) < limit:
            key = rest.keys[rest.at]
            rest.at += 1
            if fresh or present(key):
                page.append(key)
        if rest.at >= len(rest.keys) or not page:
            return page, None
        if len(rest.keys) > MIN_KEYS:
            self._keep(prefix, page[-1], rest)
        return page, page[-1]

    def _take(self, prefix: str, start_after: str) -> _Rest | None:
        now = self._clock()
        with self._lock:
            for name, kept in list(self._kept.items()):
                if now - kept.used_at > IDLE_S:
                    del self._kept[name]
            return self._kept.pop((prefix, start_after), None)

    def _keep(self, prefix: str, last: str, rest: _Rest) -> None:
        rest.used_at = self._clock()
        with self._lock:
            self._kept[(prefix, last)] = rest
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)
