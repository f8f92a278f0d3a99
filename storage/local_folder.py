"""The local object store's folder (``storage.local_store``): the state every part of
the store shares, set up once (the log replayed, the small objects' table opened), and
what every write goes through: a key's path and lock, the temporary file flushed before it
is renamed into place, the change's record in the log, the folders made for it, and the
runners that make it on the caller's thread or off the loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from storage import blanks, cursors, small_objects, wal
from storage.keys import check_object_key
from storage.local_fs import _NO_OBJECT, _in_the_way, _place_folder, _start_writeback
from storage.local_io import _Inline, _raise_translated, _threads, _translated
from storage.local_locks import _Contended, _Stripes
from storage.loop_batches import LoopBatches
from torpor.errors import ConfigError, StorageUnavailable

P = ParamSpec("P")
T = TypeVar("T")

_LOCKS = ".locks"
_TMP = ".tmp"
_WAL = ".wal"
_SMALL = ".small"
CREATES_AT_ONCE = 64
# key, body, and whether the caller stages it (``stage_if_absent``).
_Create = tuple[str, bytes, bool]
# A small object's create (``storage.small_objects``): key, body, etag.
_RowCreate = tuple[str, bytes, str]


class LocalFolder:
    """The state the store's parts share; ``LocalObjectStore`` composes them over it."""

    @staticmethod
    def objects_in(root: str | Path) -> Path:
        """The folder of a store at ``root`` that holds the objects themselves; the rest
        of ``root`` is the store's own (its log, preallocated, locks and spare files), for
        a measure of what the objects take."""
        return Path(root).expanduser().resolve() / "objects"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._tmp = str(self.root / _TMP)
        # Folders this process knows exist; a folder is never removed, so the cache
        # cannot go stale.
        self._dirs: set[str] = set()
        self._objects = str(self.objects_in(self.root))
        try:
            for sub in (_LOCKS, _TMP):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"local object store {self.root} is not writable: {exc}") from exc
        # Creates asked for together in an event loop, made together (``storage.loop_batches``).
        self._creates: LoopBatches[_Create, tuple[str, int]] = LoopBatches(
            at_once=CREATES_AT_ONCE, failed=_translated
        )
        self._inline = _Inline()
        self._cursors = cursors.Cursors()
        self._locks = _Stripes(str(self.root / _LOCKS))
        # What killed processes left in ``.tmp`` (made-ahead blanks, half-done writes).
        _threads().submit(blanks.sweep, self._tmp, boot=wal.boot_id())
        folder = str(self.root / _WAL)
        boot = wal.boot_id()
        self._blanks = blanks.Blanks(
            self._tmp,
            submit=lambda make: _threads().submit(make),
            # The log's checkpoint mark; nothing that holds the store (its finalizer
            # holds this object: a reference back would keep the store for ever).
            settled=functools.partial(wal.read_mark, folder, boot),
            boot=boot,  # kept files are handed between processes (``spare``)
        )
        self._blank_folders = blanks.Blanks(
            self._tmp, submit=lambda make: _threads().submit(make), folders=True
        )
        try:
            wal.recover(folder, apply=self._replay, flush_root=str(self.root))
        except OSError as exc:
            raise ConfigError(f"local object store {self.root}: log replay failed: {exc}") from exc
        self._log = wal.WriteAheadLog(folder, flush=self._inline.log_flushed, boot=boot)
        # The objects every webhook creates, as rows (``storage.small_objects``): what an
        # older version left as files under their prefixes moved in first, the log's
        # replay included.
        try:
            self._rows = small_objects.SmallObjects(
                str(self.root / _SMALL), flush=self._inline.log_flushed, boot=boot
            )
            self._rows.adopt(self._objects, forget=self._forget)
        except (OSError, StorageUnavailable) as exc:
            raise ConfigError(f"local object store {self.root}: {exc}") from exc
        # Another process's failed flush of the rows' log, learned of by a process that
        # does not write (its flushes look themselves), for its health (``trouble``).
        self._log.watch(self._rows.look_for_failure)
        self._row_creates: LoopBatches[_RowCreate, int] = LoopBatches(
            at_once=CREATES_AT_ONCE, failed=_translated
        )
        self._row_syncs: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, asyncio.Future[None]
        ] = weakref.WeakKeyDictionary()
        # Descriptors held for the store's life (lock files, log segments): given back
        # when it is closed or collected, so that a process that opens many stores (a
        # test run) does not run out of them.
        self._finalizer = weakref.finalize(
            self,
            _release,
            self._locks,
            self._log,
            self._blanks,
            self._blank_folders,
            rows=self._rows,
        )

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    # -- paths ----------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        # A plain string join: pathlib's cost 6.6 us a path here, on every object a
        # webhook reads or writes (the key is checked, so no "..", no absolute part).
        return f"{self._objects}/{check_object_key(key)}"

    def _locked(self, key: str, *, wait: bool = True) -> contextlib.AbstractContextManager[None]:
        """The key's exclusive lock; without ``wait``, ``_Contended`` if it is held."""
        return self._locks.held(key, wait=wait)

    def _write_tmp(self, data: bytes) -> str:
        """A temporary file holding ``data``, its bytes flushed (``_written``)."""
        (written,) = self._written([data])
        if isinstance(written, BaseException):
            raise written
        return written

    def _written(self, datas: list[bytes]) -> list[str | OSError]:
        """A temporary file holding each of ``datas`` (or the error that stopped it), its
        bytes flushed before it is renamed into place.

        A change is logged only after its rename, and the folder's entries and the
        files' bytes reach the disk in any order (no journal orders them here): a writer
        killed between the rename and its record, then a power cut, would leave a name
        the log can neither redo nor undo, pointing at bytes never written. A replace
        lost the acknowledged object that way once a checkpoint had dropped its record,
        and a create left an empty object where none was acknowledged. Flushed first,
        whatever the disk kept of the rename names whole bytes.

        Several files start their writeback together (``_start_writeback``) before any
        is waited for: 16 flushed one after another took 6.0 ms here, 1.7 ms so."""
        out: list[str | OSError] = []
        opened: list[tuple[int, int]] = []  # (index in out, fd)
        try:
            for data in datas:
                try:
                    tmp, fd = self._open_tmp(data)
                except OSError as exc:
                    out.append(exc)
                    continue
                opened.append((len(out), fd))
                out.append(tmp)
                if len(datas) > 1:
                    _start_writeback(fd)
            for i, fd in opened:
                # A large object's record says it is flushed in place (``DURABLE``): its
                # size, like its bytes, must be on disk (``fsync``). The log has the rest.
                large = len(datas[i]) > wal.RECORD_MAX_BYTES
                try:
                    self._inline.flushed(fd, None if large else os.fdatasync)
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(str(out[i]))
                    out[i] = exc
        except BaseException:
            for i, _ in opened:
                if isinstance(out[i], str):
                    with contextlib.suppress(OSError):
                        os.unlink(str(out[i]))
            raise
        finally:
            for _, fd in opened:
                os.close(fd)
        return out

    def _logged(self, key: str, path: str, data: bytes) -> int:
        """Log the change just made to ``key`` (its lock held): its content, or for a
        large object, flushed with its file already, the folder's entry flushed now."""
        if len(data) > wal.RECORD_MAX_BYTES:
            return self._logged_in_place(key, path)
        return self._log.append(wal.Op.PUT, key, data)

    def _logged_in_place(self, key: str, path: str) -> int:
        """Log a large object placed at ``key`` (its lock held), its file flushed when it
        was written: its folder's entry is flushed now, and the record says so.

        So is every folder's above it, up to the store's root: a replay writes nothing
        for a ``DURABLE`` record, and a folder made for the object (``_parent``: renamed
        into place, or ``makedirs``) has an entry in its own parent that nothing else
        flushes before the next checkpoint. Lost to a power cut, it took the
        acknowledged object with it (and a move's removal of the old name, replayed,
        the object itself). Large objects are rare; a clean folder's flush is cheap."""
        folder = os.path.dirname(path)
        while True:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._inline.flushed(fd)
            finally:
                os.close(fd)
            if folder == str(self.root) or not folder.startswith(f"{self.root}/"):
                break
            folder = os.path.dirname(folder)
        return self._log.append(wal.Op.DURABLE, key)

    def _forget(self, keys: list[str]) -> None:
        """Removals of files moved into the table (``SmallObjects.adopt``) logged and
        flushed before the files go: a replay ends on them, not on the file's put."""
        ticket = 0
        for key in keys:
            with self._locked(key):
                ticket = self._log.append(wal.Op.DELETE, key)
        if ticket:
            self._log.sync(ticket)

    def _replay(self, record: wal.Record) -> None:
        """One change from a log of an earlier boot, made again (flushed by the caller)."""
        path = self._file(record.key)
        if record.op is wal.Op.DELETE:
            # Gone already, or its name is objects' folder now (``a`` removed, then
            # ``a/b`` put): no object there either way.
            with contextlib.suppress(*_NO_OBJECT):
                os.unlink(path)
            return
        self._parent(path)
        tmp, fd = self._open_tmp(record.data)
        os.close(fd)
        os.replace(tmp, path)

    def _open_tmp(self, data: bytes) -> tuple[str, int]:
        """A temporary file holding ``data`` (written, not yet durable), still open."""
        blank = self._blanks.take()  # made ready in a worker thread (``storage.blanks``)
        try:
            fd = os.open(blank, os.O_WRONLY) if blank is not None else -1
        except FileNotFoundError:  # removed by hand meanwhile: made here instead
            fd = -1
        if blank is not None and fd >= 0:
            tmp = blank
        else:
            # O_EXCL on a random name: the same guarantee as mkstemp with fewer syscalls
            # (this is on every webhook's path). Named as a blank: swapped out by a
            # replace, it holds the old object's file, kept while this process runs.
            tmp = self._blanks.name()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp, fd

    def _parent(self, path: str | Path) -> None:
        parent = os.path.dirname(path)
        if parent in self._dirs:
            return
        if not os.path.isdir(parent):  # a stat: an existing folder costs no made-ahead one
            blank = self._blank_folders.take()
            if blank is None or not _place_folder(blank, parent):
                if blank is not None and os.path.isdir(blank):  # there already, or no parent
                    self._blank_folders.give_back(blank)
                try:
                    os.makedirs(parent, exist_ok=True)
                except (FileExistsError, NotADirectoryError):  # an object's file on the way
                    raise _in_the_way(os.path.relpath(path, self._objects)) from None
        self._dirs.add(parent)

    async def _durable(self, ticket: int) -> None:
        """Return once the log's record ``ticket`` is flushed (at once if it is)."""
        if not self._log.synced(ticket):
            await self._write(lambda _wait: self._log.sync(ticket), size=0)

    async def _write(self, write: Callable[[bool], T], *, size: int) -> T:
        """A locked write, ``write(wait)``: on the caller's thread when ``_Inline`` allows
        it and the key's lock is free, else in a worker thread, waiting for the lock."""
        if self._inline.allows(size):
            try:
                return self._inline.run(functools.partial(write, False))
            except _Contended:
                pass  # another process holds the key: wait for it off the loop
            except OSError as exc:
                _raise_translated(exc)
        return await self._off_loop(write, True)

    async def _off_loop(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        self._inline.in_flight += 1
        try:
            return await loop.run_in_executor(_threads(), lambda: fn(*args, **kwargs))
        except OSError as exc:
            _raise_translated(exc)
        finally:
            self._inline.in_flight -= 1


def _release(
    locks: _Stripes,
    log: wal.WriteAheadLog,
    *made: blanks.Blanks,
    rows: small_objects.SmallObjects,
) -> None:
    if wal.own_thread():
        # The store was collected on one of its log's own threads, which may hold the
        # log's lock (a collection set off by an allocation under it): released there,
        # it would wait for itself. Another thread waits for the lock instead.
        threading.Thread(
            target=_release,
            args=(locks, log, *made),
            kwargs={"rows": rows},
            name="torpor-store-release",
            daemon=True,
        ).start()
        return
    locks.close()
    log.release()
    rows.close()
    for made_ahead in made:
        made_ahead.close()
