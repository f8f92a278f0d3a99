"""A walk of a large folder of the local store: repair's walk of the live markers.

    .venv/bin/python bench/bench_listing.py [--keys 100000] [--old-pages 10]

``--keys`` empty live markers (``live/{session}``, what each sleeping session has) are
made directly in a temporary store folder (a synthetic writer: the files alone matter
here), then walked a page of 1,000 at a time as ``ObjectSnapshots.list_live`` does:
once through ``LocalObjectStore.walk`` (the walk's rest kept between pages,
``storage.cursors``), once through ``list``, as before, every page listing and sorting
the whole folder again, for ``--old-pages`` pages only, the whole walk's time
extrapolated from them (it grows with the folder's size per page: quadratic). Then
retention's question every sweep, the first 100 ended markers of ``--days`` days of
``--per-day`` each (``ended/{day}/{session}``), read in key order visiting only the
folders it needs (``storage.folder_pages``) and as before (every day walked, every
marker sorted). One run; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage import local_store  # noqa: E402
from storage.local_store import LocalObjectStore  # noqa: E402

PAGE = 1000


def make_markers(root: Path, n: int) -> None:
    live = root / "objects" / "live"
    live.mkdir(parents=True)
    for i in range(n):
        os.close(os.open(live / f"s_{i:020d}", os.O_CREAT | os.O_WRONLY, 0o600))


async def walk(
    store: LocalObjectStore, max_pages: int | None, *, walked: bool = True
) -> tuple[int, list[float]]:
    """Keys seen and each page's seconds, through ``walk`` or ``list``."""
    pages = store.walk if walked else store.list
    token: str | None = None
    seen, times = 0, []
    while max_pages is None or len(times) < max_pages:
        started = time.perf_counter()
        page = await pages("live/", start_after=token, limit=PAGE)
        times.append(time.perf_counter() - started)
        seen += len(page.keys)
        if page.next_token is None:
            break
        token = page.next_token
    return seen, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--old-pages", type=int, default=10)
    parser.add_argument("--days", type=int, default=30, help="days of ended markers")
    parser.add_argument("--per-day", type=int, default=3000, help="ended markers a day")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torpor-listing-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        make_markers(root, args.keys)
        print(f"{args.keys:,} live markers made in {time.perf_counter() - started:.1f} s")
        store = LocalObjectStore(root)
        pages = -(-args.keys // PAGE)

        seen, times = asyncio.run(walk(store, None))
        assert seen == args.keys, f"walked {seen} of {args.keys}"
        total, then = sum(times), statistics.median(times[1:] or [0.0])
        print(
            f"kept between pages: the whole walk ({pages:,} pages) {total:.2f} s; first page"
            f" {1000 * times[0]:.1f} ms, then median {1000 * then:.2f} ms a page"
        )

        _, old = asyncio.run(walk(store, args.old_pages, walked=False))
        per_page = statistics.median(old)
        print(
            f"listed again for every page (first {len(old)} pages): median"
            f" {1000 * per_page:.1f} ms a page; the whole walk about {per_page * pages:.1f} s"
            f" ({per_page * pages / total:.0f} x)"
        )
        print(
            "target: repair bounded by live sessions (each page's cost independent of the"
            " folder's size after the first)"
        )
        ended_days(root, store, args.days, args.per_day)


def every_key(base: Path, folder: str) -> list[str]:
    """How ``list`` read a prefix before: every file under its folder, walked whole."""
    keys: list[str] = []
    for dirpath, _dirs, files in os.walk(base / folder):
        rel = Path(dirpath).relative_to(base).as_posix()
        keys.extend(f"{rel}/{name}" for name in files)
    return keys


def ended_days(root: Path, store: LocalObjectStore, days: int, per_day: int) -> None:
    """Retention's question every sweep: the first 100 ended markers (``ended/{day}/``),
    read in key order visiting only the folders needed (``storage.folder_pages``), and as
    before, every day's folder walked and every marker sorted (``local_store._page``)."""
    for day in range(days):
        folder = root / "objects" / "ended" / f"2026{1 + day // 28:02d}{1 + day % 28:02d}"
        folder.mkdir(parents=True)
        for i in range(per_day):
            os.close(os.open(folder / f"s_{i:020d}", os.O_CREAT | os.O_WRONLY, 0o600))
    now, before = [], []
    for _ in range(5):
        started = time.perf_counter()
        page = store._list("ended/", None, 100)
        now.append(time.perf_counter() - started)
        started = time.perf_counter()
        old = local_store._page(every_key(root / "objects", "ended"), "ended/", None, 100)
        before.append(time.perf_counter() - started)
        assert page == old
    print(
        f"retention's first page of {days} days x {per_day:,} ended markers: median"
        f" {1000 * statistics.median(now):.2f} ms, against {1000 * statistics.median(before):.1f}"
        f" ms walking every day ({statistics.median(before) / statistics.median(now):.0f} x)"
    )


if __name__ == "__main__":
    main()
