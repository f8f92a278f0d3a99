"""The local object store's creates (``storage.local_store``): the creates one event
loop asks for together written, moved into place create-only and logged in one go, then
made durable by one flush of the log (or left to a later one when staged); and the create
made at once, without a record, for an object that need not survive a power cut."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence

from storage.local_folder import LocalFolder, _Create
from storage.local_fs import _place_new, _taken, etag_of
from storage.local_io import _raise_translated, _translated
from storage.local_locks import _Contended
from torpor.faults import CrashPoint, crash_point

# (Inside the class, ``list`` names its method.)
_Creates = list[_Create]
_Created = list[tuple[str, int] | Exception]  # each one's etag and log ticket, or error


class LocalCreates(LocalFolder):
    """Creates of objects held as files (``put_if_absent``, ``stage_if_absent``)."""

    def _create_all(
        self, items: list[tuple[str, bytes]], wait: bool = True
    ) -> list[str | Exception]:
        """``put_if_absent`` of several objects in one go: every body written, each
        moved into place and logged under its key's lock, then one flush of the log for
        all (an etag, or the error, for each; without ``wait``, ``_Contended`` for a key
        whose lock is held elsewhere)."""
        out, ticket = self._place_all(items, wait)
        try:
            if ticket:
                self._log.sync(ticket)
        except Exception as exc:  # the log could not be flushed: none of them is durable
            out = [exc if isinstance(result, str) else result for result in out]
        return out

    def _place_all(
        self, items: list[tuple[str, bytes]], wait: bool
    ) -> tuple[list[str | Exception], int]:
        """Every body written, each moved into place and logged, none flushed: an etag or
        the error for each, and the log's ticket of the last one placed (0 if none)."""
        out: list[str | Exception] = []
        paths: list[tuple[int, str]] = []  # (item, path)
        for i, (key, data) in enumerate(items):
            try:
                path = self._file(key)
                self._parent(path)
            except Exception as exc:
                out.append(exc)
                continue
            out.append(etag_of(data))
            paths.append((i, path))
        opened: list[tuple[int, str, str]] = []  # (item, path, tmp)
        written = self._written([items[i][1] for i, _ in paths])
        for (i, path), tmp in zip(paths, written, strict=True):
            if isinstance(tmp, str):
                opened.append((i, path, tmp))
            else:
                out[i] = tmp
        ticket = 0
        placed: set[int] = set()
        try:
            for i, path, tmp in opened:
                key, data = items[i]
                try:
                    with self._locked(key, wait=wait):
                        _place_new(tmp, path)
                        placed.add(i)
                        crash_point(CrashPoint.STORE_AFTER_PLACE)
                        ticket = self._logged(key, path, data)
                except FileExistsError:
                    out[i] = _taken(key, path)
                except (OSError, _Contended) as exc:
                    out[i] = exc
        finally:
            for i, _, tmp in opened:
                if i not in placed:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
        return out, ticket

    async def _queued(self, key: str, data: bytes, *, staged: bool) -> tuple[str, int]:
        """A create made with the others asked for in this loop (``_create_batch``)."""
        return await self._creates.call((key, data, staged), self._create_batch)

    def _create_now(self, key: str, data: bytes) -> str:
        """Create-only without a record in the log: written to a temporary file and
        linked into place, so readers never see it half-written and one creator wins, as
        ever. It outlives any process (the page cache is the kernel's), not a power cut,
        which may take its name; its bytes are flushed before it is linked all the same
        (``_written``: no power cut leaves its name on bytes never written). Made on the
        caller's thread: queued behind a batch's flushes it cost the replay marker (a
        file then, a row now: ``storage.small_objects``) a whole flush of waiting."""
        try:
            path = self._file(key)
            self._parent(path)
            tmp = self._write_tmp(data)
            try:
                _place_new(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except FileExistsError:
            raise _taken(key, path) from None
        except OSError as exc:
            _raise_translated(exc)
        return etag_of(data)

    async def _create_batch(self, batch: _Creates) -> _Created:
        """Creates asked for together: each one's etag and the log's ticket still to be
        flushed for it (0: durable already), or its error."""
        items = [(key, data) for key, data, _ in batch]
        # A create staged alone is placed and logged, not flushed: its caller's next
        # create flushes both (``stage_if_absent``). Together, all are flushed.
        staged = len(batch) == 1 and batch[0][2]
        results: Sequence[str | tuple[str, int] | Exception]
        if len(items) == 1 and self._inline.allows(len(items[0][1])):
            # Alone a tick after it was asked for, with nothing else in flight: made here,
            # flush included (``_Inline``); creates that came together go to a worker
            # thread, one hop for all, while the loop serves on.
            if staged:
                results = _unflushed(
                    *self._inline.run(functools.partial(self._place_all, items, False))
                )
            else:
                results = self._inline.run(functools.partial(self._create_all, items, False))
            if isinstance(results[0], _Contended):  # locked elsewhere: wait off the loop
                results = await self._off_loop(self._create_all, items)
        elif staged:
            results = _unflushed(*await self._off_loop(self._place_all, items, True))
        else:
            results = await self._off_loop(self._create_all, items)
        return [
            (result, 0)
            if isinstance(result, str)
            else result
            if isinstance(result, tuple)
            else _translated(result)
            for result in results
        ]


def _unflushed(
    results: list[str | Exception], ticket: int
) -> list[str | tuple[str, int] | Exception]:
    """``_place_all``'s results, each etag paired with the ticket still to be flushed."""
    return [(r, ticket) if isinstance(r, str) else r for r in results]
