"""The process's file descriptor table, grown once at start-up instead of on a request.

Linux keeps a process's open files in one table that starts with 64 slots and doubles
when an ``open``, ``socket`` or ``accept`` needs a slot past its end. In a process with
more than one thread, the doubling waits for an RCU grace period before it frees the old
table (``expand_files`` → ``synchronize_rcu``): the thread that asked sleeps for
milliseconds, holding nothing but the request it serves. A replica or a pool host runs
dozens of threads (Ray's, the store's) and opens files on every webhook and every
commit, so its table grew in its first seconds of traffic, inside a request: the
off-CPU stack of the slowest back-to-back webhook of a benchmark pass (202 in 14.8 ms,
the 38th sent; the 44th in the two passes before) was that wait, 9.4 ms in one
``openat``, which returned descriptor 128.

The table never shrinks, so one descriptor opened at a high number and closed again at
start-up pays the wait there, once. A few thousand slots cost a few tens of KiB of
kernel memory per process.
"""

from __future__ import annotations

import fcntl
import os
import resource

SLOTS = 4096  # a replica holds a few hundred files and sockets open at its busiest

_grown_in: int | None = None  # the process that grew its table (a forked child has a copy)


def table_size() -> int | None:
    """The process's descriptor table size (``FDSize`` in ``/proc/self/status``), or None
    where the kernel does not say."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"FDSize:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reserve_descriptors(slots: int = SLOTS) -> int | None:
    """Grow this process's descriptor table to ``slots`` (never past the open-files
    limit) now, once per process. Returns the table's size after, where it is known."""
    global _grown_in
    if _grown_in == os.getpid():
        return table_size()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(slots, soft if soft != resource.RLIM_INFINITY else slots) - 1
    size = table_size()
    if top > 0 and (size is None or size <= top):
        try:
            probe = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            probe = -1  # at the limit already, or no /dev/null: grown on demand, as before
        if probe >= 0:
            try:
                # The lowest free descriptor at or above ``top``: unlike dup2 it never
                # closes a descriptor some other thread holds there.
                os.close(fcntl.fcntl(probe, fcntl.F_DUPFD_CLOEXEC, top))
            except OSError:
                pass  # past the limit: the table grows on demand, as before
            finally:
                os.close(probe)
    _grown_in = os.getpid()
    return table_size()
