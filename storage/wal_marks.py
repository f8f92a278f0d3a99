"""The write-ahead log's marks beside its segments (``storage.wal``): the boot a process
runs in, each boot's checkpoint mark (every change timestamped before it is on disk), the
marker a failed flush of the boot leaves (``failed-<boot>``), and the flushes (of a
folder's entries, of a whole file system) that make them durable."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
from collections.abc import Iterator

BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    try:
        with open(BOOT_ID_FILE) as fh:
            return fh.read().strip()
    except OSError:  # not Linux: no reboot can be told apart, so every log is this boot's
        return "unknown"


def syncfs(fd: int) -> None:
    """Flush the whole file system ``fd`` is on: one call, not one per file."""
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, "syncfs", None) is None:
        os.sync()
        return
    if libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mark_file(folder: str, boot: str) -> str:
    return f"{folder}/mark-{boot}"


def read_mark(folder: str, boot: str) -> int:
    """The boot's checkpoint mark: every change timestamped before it is on disk."""
    try:
        with open(_mark_file(folder, boot)) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


_FAILED_PREFIX = "failed-"


def _failed_file(folder: str, boot: str) -> str:
    return f"{folder}/{_FAILED_PREFIX}{boot}"


def record_failure(folder: str, boot: str) -> None:
    """Say, durably, that a flush of what ``folder`` holds failed in ``boot``: no later
    flush of the boot, in any process, may vouch for what it covered (best effort: the
    disk is failing). Seen by other processes as soon as the name is made, before the
    folder's flush: they look for it with ``failure_recorded``. Here, a checkpoint's flush
    of the file system; in ``storage.small_objects``, a flush of its table's log."""
    with contextlib.suppress(OSError):
        os.close(os.open(_failed_file(folder, boot), os.O_WRONLY | os.O_CREAT, 0o600))
        fsync_dir(folder)


def failure_recorded(folder: str, boot: str) -> bool:
    """Whether a flush of what ``folder`` holds failed in ``boot``, in any process
    (``record_failure``): one stat. A reboot's page cache holds none of the pages a
    failed writeback dropped, so another boot's failure is not looked for."""
    return os.path.exists(_failed_file(folder, boot))


def forget_earlier_failures(folder: str, boot: str) -> None:
    """Remove the markers (``record_failure``) of every boot but ``boot``: what their
    failed flushes dropped went with their page cache, and nothing looks for them again.
    Never raises (a marker left is looked for by no one); a removal a power cut undoes
    is made again by the next call."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    mine = os.path.basename(_failed_file(folder, boot))
    for name in names:
        if name.startswith(_FAILED_PREFIX) and name != mine:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _write_mark(folder: str, boot: str, mark: int) -> None:
    """Set the boot's checkpoint mark to ``mark``, durably (in place of the old one)."""
    path = _mark_file(folder, boot)
    tmp = f"{path}.{secrets.token_hex(4)}"
    with open(tmp, "w") as fh:
        fh.write(str(mark))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    """A folder's entries (names made, renamed, removed) flushed to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _folder_lock(folder: str, name: str) -> Iterator[None]:
    fd = os.open(f"{folder}/{name}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
