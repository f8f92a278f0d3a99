"""Empty files made ready ahead of the writes that need them.

Creating a file was the largest single cost of a durable write in the local folder
store: the new inode, 0.6–0.7 ms in the middle of a webhook (strace, one at a time:
``openat(O_CREAT)`` 710 µs median, against 26 µs for the rename that puts the file in
place and 240 µs for the log's flush). A write cannot name its file before it has its
content, but it does not need to create it then: the store keeps a few empty files of
its own, made in a worker thread between writes, and a write takes one, fills it and
renames it into place. The inodes are allocated all the same, off the caller's path.
Folders the same: a new folder (``mkdir``: an inode and a block) cost 240 µs; one made
ahead is renamed into place.

A blank is created with ``O_EXCL`` under a random name and handed out once, so the
file a write takes is empty and no one else's. A forked child takes none (its parent
may hand out the same names). A blank's name carries its maker's process id and start
time: those left
by a process that was killed (empty files and folders in the store's ``.tmp`` folder,
up to ``2 * HIGH`` per process, and up to ``KEEP_MAX`` kept files) are removed by
``sweep`` when a store next opens the folder, with the temporary files of writes that a
killed process left half-done.

**Inodes are recycled, not freed** (``recycle``). An object replaced or removed leaves
its old file here (the store swaps it out with ``renameat2(RENAME_EXCHANGE)``, or moves
it out on a delete); later it is truncated and handed out as a blank.
On this machine's file system (ext4 without a journal) every new inode is searched for
from the start of its group, past each inode freed in the last 5 to 300 s
(``recently_deleted`` in the kernel). Every resume frees three (each snapshot commit
frees the snapshot's old file); after a few thousand frees that search took 35-40 % of
the gateway's CPU in one process (perf, ``bench/profile_gateway.py``), and a create
held the ``.tmp`` folder's lock for hundreds of microseconds while the writes that move
files out of it waited (``rwsem_spin_on_owner``).
A file that keeps its inode frees nothing and allocates nothing. Two things must be true
before it is written again. Its removal from its key must be on disk
(``settled``: a checkpoint's ``syncfs`` started after it left the key): on a file
system without a journal nothing orders the writes of two folders, and a power cut
could otherwise leave the old key and the new one naming the same file (the kernel's
own guard against reusing a freed inode too soon is only that time window).
And no reader may still be reading it: a reader that opened the old file before it
was swapped out checks after its read that the key still names the same file, unchanged
(``local_fs._unchanged``), and the quarantine (``QUARANTINE_S``, far longer than a
timestamp's granularity) is what makes that check sufficient.

**Kept files outlive their process** (``spare``). A store that closes (a replica or pool
host restarting) held up to ``KEEP_MAX`` kept files, and a burst of deletes (retention)
more than that: freeing them all at once slowed every create on the file system for
minutes (the search above), the next process's included. They are moved instead into
the shared ``spare`` folder, named with the time they left their keys and the boot, and
any store of the folder takes them from there when it has no kept file of its own ready
(a rename: one process wins each), under the same two conditions. About ``SPARE_MAX``
wait there at most (each process counts them again once a second), past that they are
freed as before. A spare of another boot is removed by ``sweep`` (its times mean
nothing now), and one still holding an object's bytes an hour after it left its key by
``sweep`` or by any store that lists the folder: a deleted object's bytes never wait
there for ever.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import secrets
import stat
import threading
import time
from collections import deque
from collections.abc import Callable

LOW = 8  # fewer than this left: make more
HIGH = 32  # ... up to this many
FILL_WAIT_S = 10.0  # ``fill`` waits this long at most for a make already running
# What ``sweep`` removes must be at least this old: a write's temporary file lives for
# milliseconds, and a blank of a live process in another pid namespace (whose id means
# nothing here) is taken long before, unless that process has idled this long.
STALE_S = 3600.0
# An object's old file is written again at least this long after it left its key: if it
# ever comes back to that key, its ``ctime`` has moved on, and a reader that opened it
# before sees the change (``local_fs._unchanged``) and reads the key again.
QUARANTINE_S = 10.0
# Old files kept to be recycled, per process, at most: more than this (a burst of
# deletes) are handed over (``spare``) or freed. Each is an empty inode and a name in
# ``.tmp`` once recycled.
KEEP_MAX = 8192
# ... and the bytes they hold until they are reused, at most: a file that would
# take more is handed over or freed at once (a large object replaced: freed), so
# recycling never holds much disk (a snapshot is a few KiB; 8,192 of them, tens of MiB).
KEEP_BYTES = 64 << 20
# Kept files handed to other processes (``spare``), at most, in all: an inode and a
# name each (they hold their old content until taken).
SPARE_MAX = 16384
# ... each holding at most this much until it is taken (a snapshot is a few KiB): a
# larger file is freed, so the folder never holds more than ``SPARE_MAX`` times this.
SPARE_FILE_BYTES = 16 << 10
SPARE = "spare"  # the shared folder, inside the blanks' folder
RELIST_S = 1.0  # ``spare`` is listed (and counted) again at most this often per process


class Blanks:
    """Empty files (or, with ``folders``, empty folders) in ``folder``, made by
    ``submit``ted calls in a worker thread."""

    def __init__(
        self,
        folder: str,
        *,
        submit: Callable[[Callable[[], None]], object],
        folders: bool = False,
        settled: Callable[[], int] = lambda: 0,
        boot: str = "",
    ) -> None:
        self.folder = folder
        # Files are handed to and taken from other processes through ``spare`` only with
        # a boot to name them by (``CLOCK_MONOTONIC`` times compare within one boot).
        self._boot = "" if folders else boot
        self._spare = f"{folder}/{SPARE}"
        self._spares: deque[tuple[int, str]] = deque()  # (left its key, ns; name), listed
        self._spares_listed_at = float("-inf")
        self._spares_seen = 0  # how many are there, as last counted (plus ours since)
        self._counted_at = float("-inf")
        # The ``CLOCK_MONOTONIC`` time (ns) before which every change is on disk (the
        # log's checkpoint mark): a kept file is reused only once it left its key before.
        self._settled = settled
        self._settled_mark, self._settled_read_at = 0, float("-inf")
        self.folders = folders
        self._submit = submit
        self._ready: deque[str] = deque()
        # Old files of objects (``recycle``), in the order they left their keys: (the
        # monotonic time the quarantine ends, when it left its key in ns, path, size).
        self._cooling: deque[tuple[float, int, str, int]] = deque()
        self._kept_bytes = 0  # what the files in ``_cooling`` hold (under ``_lock``)
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)  # a make in a worker thread ended
        self._making = False
        self._closed = False
        self._pid = os.getpid()
        # What ``sweep`` tells this process's blanks by: its pid and its start time.
        self._tag = f"{self._pid}-{_started(self._pid) or 0}"

    def take(self) -> str | None:
        """The path of an empty file of ours, or None (the caller creates its own)."""
        if self._pid != os.getpid():
            return None
        try:
            path: str | None = self._ready.popleft()
        except IndexError:
            path = None
        if len(self._ready) < LOW:
            with self._lock:
                start = not self._making and not self._closed
                self._making = self._making or start
            if start:
                self._submit(self._make)
        return path

    def fill(self, *, wait_s: float = FILL_WAIT_S) -> None:
        """Make blanks up to ``HIGH`` now, on the caller's thread (a store getting ready
        for traffic). A make already running in a worker thread is waited for (up to
        ``wait_s``), then topped up: returning while it ran would leave the first write
        queued behind it on the folder's lock, which is what getting ready is for."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if not self._made.wait_for(lambda: not self._making or self._closed, wait_s):
                return  # a make that hangs (a stuck disk): the writes make their own
            if self._closed:
                return
            self._making = True
        self._make()

    def name(self) -> str:
        """A new name for a file of ours in the folder (what ``sweep`` knows as ours)."""
        return f"{self.folder}/blank-{self._tag}-{secrets.token_hex(12)}"

    def recycle(self, path: str, status: os.stat_result) -> None:
        """``path``, in the folder, holds a file that was an object's until now (its
        ``lstat`` taken at its key, ``status``): kept to be a blank once its removal is
        on disk and no reader can still be reading it, rather than freed. Past this
        process's bounds it is handed over (``spare``) if there is room there, else
        freed; freed at once by a forked child (whose copy of the lock may be held for
        ever)."""
        left_ns = time.monotonic_ns()
        size = status.st_size
        ours = self._pid == os.getpid()
        # Only a plain file named nowhere else: a link a key held, or a file a backup
        # also links to, must never be emptied and given another object's bytes (checked
        # again, on the open file, before it is emptied: ``_emptied``), nor handed over.
        plain = stat.S_ISREG(status.st_mode) and status.st_nlink == 1
        keep = ours and plain
        if keep:
            with self._lock:
                keep = (
                    not self._closed
                    and len(self._cooling) < KEEP_MAX
                    and self._kept_bytes + size <= KEEP_BYTES
                )
                if keep:
                    due = left_ns / 1e9 + QUARANTINE_S
                    self._cooling.append((due, left_ns, path, size))
                    self._kept_bytes += size
        if keep:
            return
        if ours and plain and self._boot and size <= SPARE_FILE_BYTES and not self._closed:
            # Handed over in a worker thread: it may list ``spare`` first (the caller may
            # be an event loop). Until then it is a file of ours in the folder, as any.
            self._submit(functools.partial(self._hand_over_or_free, path, left_ns, size))
            return
        with contextlib.suppress(OSError):
            os.unlink(path)

    def _hand_over_or_free(self, path: str, left_ns: int, size: int) -> None:
        if not self._hand_over(path, left_ns, size):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _hand_over(self, path: str, left_ns: int, size: int = 0) -> bool:
        """Move the file ``path`` (of ours, ``size`` bytes, which left its key at
        ``left_ns``; 0 if it never held an object's bytes or may be written again
        already) to ``spare`` for any store of the folder to take; False if it was not
        (no boot, too large, ``spare`` full)."""
        if not self._boot or size > SPARE_FILE_BYTES:
            return False
        now = time.monotonic()
        if now - self._counted_at >= RELIST_S:
            # What every process handed over and took since: counted again at most once
            # a second, so the bound holds for the folder (give or take a second of
            # hand-overs), and room made by others is seen.
            try:
                count = len(os.listdir(self._spare))
            except FileNotFoundError:
                count = 0
            except OSError:
                return False
            with self._lock:
                self._spares_seen, self._counted_at = count, now
        with self._lock:
            if self._spares_seen >= SPARE_MAX:
                return False
            self._spares_seen += 1
        target = f"{self._spare}/{left_ns}-{secrets.token_hex(12)}-{self._boot}"
        for _ in range(2):
            try:
                os.rename(path, target)
                return True
            except FileNotFoundError:
                if not os.path.exists(path):
                    break  # swept meanwhile: nothing to hand over
                with contextlib.suppress(OSError):
                    os.mkdir(self._spare)  # made on the first hand-over
            except OSError:
                break
        with self._lock:
            self._spares_seen -= 1
        return False

    def _settled_ns(self) -> int:
        """``settled()``, read again at most once a second (it reads a file)."""
        now = time.monotonic()
        if now - self._settled_read_at >= 1.0:
            self._settled_mark, self._settled_read_at = self._settled(), now
        return self._settled_mark

    def _reused(self) -> str | None:
        """The oldest kept file that may be written again, truncated; None if none."""
        while True:
            with self._lock:
                head = self._cooling[0] if self._cooling else None
            if head is None or head[0] > time.monotonic():
                return None  # its quarantine is not over
            if head[1] >= self._settled_ns():
                return None  # its removal may not be on disk yet: after the next checkpoint
            with self._lock:
                if not self._cooling or self._cooling[0] is not head:
                    continue  # emptied by ``close`` meanwhile
                self._cooling.popleft()
                self._kept_bytes -= head[3]
            if _emptied(head[2]):
                return head[2]

    def _may_reuse(self, left_ns: int) -> bool:
        """Whether a spare that left its key at ``left_ns`` may be written again, as a
        kept file of ours (``_reused``): its quarantine is over, and a checkpoint begun
        after it left the key has completed (its removal is on disk)."""
        if left_ns == 0:
            return True  # never an object's, or cleared for reuse before it was handed over
        if left_ns / 1e9 + QUARANTINE_S > time.monotonic():
            return False
        return left_ns < self._settled_ns()

    def _claimed(self) -> str | None:
        """A file another process handed over (``spare``) that may be written again, now
        ours and emptied; None if none (``spare`` is listed again at most once a second)."""
        if not self._boot:
            return None
        while True:
            if not self._spares or (
                not self._may_reuse(self._spares[0][0]) and self._listed_long_ago()
            ):
                if self._listed_long_ago():
                    self._list_spares()
                if not self._spares:
                    return None
            left_ns, name = self._spares[0]
            if not self._may_reuse(left_ns):
                return None  # the oldest is not ready: none after it is either
            self._spares.popleft()
            path = self.name()
            try:
                os.rename(f"{self._spare}/{name}", path)
            except OSError:
                continue  # another process took it first
            with self._lock:
                self._spares_seen -= 1
            if _emptied(path):
                return path

    def _listed_long_ago(self) -> bool:
        return time.monotonic() - self._spares_listed_at >= RELIST_S

    def _list_spares(self) -> None:
        """List ``spare`` again: this boot's spares, oldest first. Those that still hold
        an object's bytes an hour after they left its key are removed: a deleted
        object's bytes do not wait there for ever when nobody takes them."""
        self._spares_listed_at = time.monotonic()
        self._spares.clear()
        try:
            names = os.listdir(self._spare)
        except OSError:
            return
        stale = time.monotonic_ns() - int(STALE_S * 1e9)
        found = []
        for left_ns, name in sorted(_spares_of(names, self._boot)):
            if 0 < left_ns < stale:
                with contextlib.suppress(OSError):
                    os.unlink(f"{self._spare}/{name}")
            else:
                found.append((left_ns, name))
        self._spares.extend(found)

    def give_back(self, path: str) -> None:
        """A blank taken and not used: the next ``take`` has it."""
        if self._closed:
            with contextlib.suppress(OSError):
                (os.rmdir if self.folders else os.unlink)(path)
        else:
            self._ready.appendleft(path)

    def _make(self) -> None:
        try:
            while len(self._ready) < HIGH and not self._closed:
                if self.folders:
                    path = f"{self.folder}/blank-d-{self._tag}-{secrets.token_hex(12)}"
                    os.mkdir(path)
                else:
                    reused = self._reused() or self._claimed()
                    if reused is None:
                        path = self.name()
                        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                    else:
                        path = reused
                self._ready.append(path)
        except OSError:
            pass  # a full or failing disk: the writes create their own files, and report it
        finally:
            with self._lock:
                self._making = False
                self._made.notify_all()
            if self._closed:
                self.close()

    def close(self) -> None:
        """Hand the kept files and the blanks not handed out to other processes
        (``spare``), or, for folders, past its bounds or without a boot, remove them."""
        self._closed = True
        if self._pid != os.getpid():
            return
        with self._lock:
            kept, self._kept_bytes = list(self._cooling), 0
            self._cooling.clear()
        for _, left_ns, path, size in kept:
            if not self._hand_over(path, left_ns, size):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        while True:
            try:
                path = self._ready.popleft()
            except IndexError:
                return
            if self.folders:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            elif not self._hand_over(path, 0):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _emptied(path: str) -> bool:
    """Empty the kept file at ``path`` (ours, in the folder) to be written again: False
    (and freed, if it is there) if it is not a plain file named nowhere else."""
    try:
        # Emptied through a descriptor closed at once: ext4 flushes a file emptied by
        # truncation when it is next closed (``auto_da_alloc``), and that close is here,
        # with nothing to flush, not the next writer's, with its data. Not followed if a
        # link, never blocked on a FIFO, re-checked once open.
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_nlink != 1:
                raise OSError(errno.EINVAL, "not a file of ours alone", path)
            os.ftruncate(fd, 0)
            os.utime(fd)  # fresh to ``sweep``: it kept its object's times
        finally:
            os.close(fd)
    except FileNotFoundError:  # swept meanwhile (it looked stale): not ours now
        return False
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    return True


def _spares_of(names: list[str], boot: str) -> list[tuple[int, str]]:
    """The spares among ``names`` handed over in ``boot``: (left its key, ns; name)."""
    suffix = f"-{boot}"
    found = []
    for name in names:
        if name.endswith(suffix):
            left, _, _ = name.partition("-")
            if left.isascii() and left.isdigit():
                found.append((int(left), name))
    return found


def sweep(folder: str, *, older_than_s: float = STALE_S, boot: str | None = None) -> int:
    """Remove from ``folder`` what killed processes left there, older than
    ``older_than_s``: blanks whose maker is no longer running, and temporary files of
    writes that never finished; with ``boot``, the spares handed over in another boot.
    Returns how many were removed. Best effort: a store works the same with them there,
    they only take inodes."""
    removed = 0 if boot is None else _sweep_spares(f"{folder}/{SPARE}", boot)
    cutoff = time.time() - older_than_s
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        blank = name.startswith("blank-")
        if blank and _alive(name):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                continue
            if entry.is_dir(follow_symlinks=False):
                os.rmdir(entry.path)  # a blank folder is empty; anything else stays
            else:
                os.unlink(entry.path)
        except OSError:
            continue
        removed += 1
    return removed


def _sweep_spares(spare: str, boot: str) -> int:
    """Remove the spares of other boots (the times in their names mean nothing now), and
    this boot's that still hold an object's bytes an hour after it left its key."""
    removed = 0
    try:
        names = os.listdir(spare)
    except OSError:
        return 0
    stale = time.monotonic_ns() - int(STALE_S * 1e9)
    ours = {name for left_ns, name in _spares_of(names, boot) if not 0 < left_ns < stale}
    for name in names:
        if name not in ours:
            with contextlib.suppress(OSError):
                os.unlink(f"{spare}/{name}")
                removed += 1
    return removed


def _alive(name: str) -> bool:
    """Whether the process that made the blank ``name`` still runs on this host (False
    for a name without a process id: a blank of an older release, removed once old).
    A name that carries its maker's start time too (``blank-{pid}-{start}-{hex}``) is
    alive only while that pid's process started then: a container's app is pid 1 after
    every restart, and a killed run's kept files must not pass for the new run's."""
    parts = name.split("-")
    if parts[1] == "d":
        parts = parts[1:]
    if len(parts) not in (3, 4) or not parts[1].isdigit() or len(parts[1]) > 10:
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:  # running, under another user
        pass
    started = _started(int(parts[1]))
    # A start time that cannot be read (``/proc`` hidden, another user's) counts as alive.
    return len(parts) == 3 or not started or parts[2] == started


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``'s 22nd
    field), or "" where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return ""
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else ""
