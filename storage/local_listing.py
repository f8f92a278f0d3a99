"""Listings of the local object store's files (``storage.local_store``): a page in key
order visiting only the folders it needs, a small flat folder listed on the caller's
thread, a walk of a large folder listed once; and a page of files merged with one of rows."""

from __future__ import annotations

import os
import sys

from storage import folder_pages
from storage.local_folder import LocalFolder
from torpor.ports import ListPage

INLINE_LIST_ENTRIES = 256


class LocalListing(LocalFolder):
    """The listings of the objects held as files."""

    def _list(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        # In key order, visiting only the folders the page needs (``storage.folder_pages``).
        return ListPage(*folder_pages.page_of(self._objects, prefix, start_after, limit))

    def _walk(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        def listed(prefix: str, after: str | None) -> list[str]:  # read as a page of ``list``
            return folder_pages.page_of(self._objects, prefix, after, sys.maxsize)[0]

        page, token = self._cursors.page(
            prefix, start_after, limit, listed=listed, present=self._present
        )
        return ListPage(page, token)

    def _present(self, key: str) -> bool:
        # Joined as listed, not checked as a key: a stray file whose name no key may
        # have (listed all the same by the first page) must not fail a later one.
        return os.path.isfile(f"{self._objects}/{key}")

    async def _list_files(self, prefix: str, start_after: str | None, limit: int) -> ListPage:
        small = self._list_small(prefix, start_after, limit)
        if small is not None:
            return small
        return await self._off_loop(self._list, prefix, start_after, limit)

    def _list_small(self, prefix: str, start_after: str | None, limit: int) -> ListPage | None:
        """A listing of one small folder of files (a session's inbox, three times per
        activation) on the caller's thread: a few microseconds against 0.5 ms for the
        hop to a worker thread and back. None for anything larger or deeper."""
        folder, _, _ = prefix.rpartition("/")
        if not folder or not folder_pages.spelled_as_keys(folder):
            return None  # the root, or a prefix spelled unlike the keys ("a//b/", "../")
        top = self.root / "objects" / folder
        keys: list[str] = []
        try:
            with os.scandir(top) as entries:
                for n, entry in enumerate(entries):
                    if n >= INLINE_LIST_ENTRIES or not entry.is_file(follow_symlinks=False):
                        return None  # large, or not flat: walked off the loop
                    keys.append(f"{folder}/{entry.name}")
        except FileNotFoundError:
            return ListPage([], None)
        except OSError:
            return None  # the worker thread reports it, with the usual translation
        return _page(keys, prefix, start_after, limit)


def _page(keys: list[str], prefix: str, start_after: str | None, limit: int) -> ListPage:
    """The keys under ``prefix`` after ``start_after``, sorted, at most ``limit``."""
    found = sorted(
        k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after)
    )
    page = found[:limit]
    return ListPage(page, page[-1] if len(found) > limit else None)


def _merged(files: ListPage, rows: list[str], limit: int) -> ListPage:
    """A page of files and the rows after the same position (one more than ``limit`` if
    there are more), as one page: each source holds every key of its own up to its last,
    so the first ``limit`` keys of both are the first ``limit`` of the two together."""
    both = sorted({*files.keys, *rows})
    page = both[:limit]
    more = files.next_token is not None or len(rows) > limit or len(both) > limit
    return ListPage(page, page[-1] if more and page else None)
