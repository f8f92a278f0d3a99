"""The rest of a long walk of the local folder store, kept for its next page.

A folder on disk cannot be read from a key onwards: every page of a listing read the
whole folder and sorted it again, so a walk of a large one cost its size once per page.
Repair walks the live markers, one per sleeping session, a page of 1,000 at a time:
1.3-1.5 s a page at a million markers here, over 20 minutes of listing alone, against
6.1 s for the whole walk now (``bench/bench_listing.py``). A *walk*
(``WalksObjects.walk``: a caller that pages through a whole prefix from its start,
passing each page's token back) of more than
``MIN_KEYS`` keys now keeps the sorted rest of its first listing, found again by the key
the page ended on; each next page takes its share of it, checking that each key is still
there. So a walk shows the keys its first listing found, less those removed since, and
not one created after it (a cursor's view, where S3 would show a key created ahead of the
cursor's position). Plain listings (``list``) never use it: each page is fresh.

A listing is reused for ``MAX_AGE_S`` after it was taken at most (then the walk lists
again), kept ``IDLE_S`` between pages at most, ``MAX_KEPT`` walks and ``MAX_KEYS`` keys
at once (the oldest let go first), and a newer listing is never replaced by an older one.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MIN_KEYS = 10_000  # below this every page lists the folder again
MAX_AGE_S = 300.0
IDLE_S = 60.0
MAX_KEPT = 4
MAX_KEYS = 4_000_000  # about 400 MB of key strings at most, across the walks kept
_COMPACT_AFTER = 65_536  # keys handed out before they are dropped from the kept list


@dataclass
class _Rest:
    keys: list[str]  # sorted; those before ``at`` were handed out already
    at: int
    taken_at: float  # when the folder was listed
    used_at: float
    large: bool = False  # more than ``MIN_KEYS`` when listed: kept to its end


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
        listed: Callable[[str, str | None], list[str]],
        present: Callable[[str], bool],
    ) -> tuple[list[str], str | None]:
        """The page of keys under ``prefix`` after ``start_after`` (and the token for the
        next, None at the end): from the rest a walk's earlier page kept, else from
        ``listed(prefix, start_after)`` (every key under the prefix after it, sorted).
        ``present`` tells whether a kept key still names an object."""
        rest = self._take(prefix, start_after) if start_after is not None else None
        fresh = rest is None
        if rest is None:
            now = self._clock()
            found = listed(prefix, start_after)
            rest = _Rest(found, 0, now, now, large=len(found) > MIN_KEYS)
        page: list[str] = []
        while rest.at < len(rest.keys) and len(page) < limit:
            key = rest.keys[rest.at]
            rest.at += 1
            if fresh or present(key):
                page.append(key)
        if rest.at >= len(rest.keys) or not page:
            return page, None
        if rest.large:
            if rest.at >= _COMPACT_AFTER and 2 * rest.at >= len(rest.keys):
                del rest.keys[: rest.at]  # now and then: amortized, not a copy per page
                rest.at = 0
            self._keep(prefix, page[-1], rest)
        else:
            # Not kept, but no older listing left at this key either: another walk's
            # next page would take it, and miss what was made since it was listed.
            self._drop_older(prefix, page[-1], rest.taken_at)
        return page, page[-1]

    def _drop_older(self, prefix: str, last: str, than: float) -> None:
        with self._lock:
            there = self._kept.get((prefix, last))
            if there is not None and there.taken_at <= than:
                del self._kept[(prefix, last)]

    def _expire(self, now: float) -> None:
        """Let go of listings idle or old (the lock is held)."""
        for name, kept in list(self._kept.items()):
            if now - kept.used_at > IDLE_S or now - kept.taken_at > MAX_AGE_S:
                del self._kept[name]

    def _take(self, prefix: str, start_after: str) -> _Rest | None:
        with self._lock:
            self._expire(self._clock())
            return self._kept.pop((prefix, start_after), None)

    def _keep(self, prefix: str, last: str, rest: _Rest) -> None:
        now = rest.used_at = self._clock()
        with self._lock:
            self._expire(now)
            there = self._kept.get((prefix, last))
            if there is not None and there.taken_at > rest.taken_at:
                return  # another walk's newer listing, at the same key: it stays
            self._kept[(prefix, last)] = rest
            self._kept.move_to_end((prefix, last))
            while len(self._kept) > MAX_KEPT or (
                len(self._kept) > 1 and sum(len(r.keys) for r in self._kept.values()) > MAX_KEYS
            ):
                self._kept.popitem(last=False)
