"""Race several OS processes on one key, round after round, and report who won.

Each worker builds its own adapter from a picklable spec, then for every round waits on a
shared barrier (so the attempts really overlap) and makes one attempt. The parent checks
that every round had exactly one winner.
"""

from __future__ import annotations

import asyncio
import faulthandler
import multiprocessing as mp
from datetime import UTC, datetime, timedelta
from typing import Any

Spec = tuple[str, dict[str, Any]]


def _open(spec: Spec) -> Any:
    kind, args = spec
    if kind == "local":
        from storage.local_store import LocalObjectStore

        return LocalObjectStore(args["root"])
    if kind == "s3":
        from storage.s3_store import S3ObjectStore

        return S3ObjectStore(args["bucket"], args.get("prefix", ""), **args["boto"])
    if kind == "redis":
        from storage.redis_index import RedisIndex

        return RedisIndex(args["url"], prefix=args["prefix"])
    if kind == "sqlite":
        from storage.sqlite_index import SqliteIndex

        return SqliteIndex(args["path"])
    raise ValueError(kind)


async def _attempt(
    target: Any, op: str, round_no: int, worker: int, etag: str | None, key_prefix: str
) -> bool:
    from torpor.errors import PreconditionFailed

    key = f"{key_prefix}round-{round_no}"
    try:
        if op == "put_if_absent":
            await target.put_if_absent(key, f"worker {worker}".encode())
        elif op == "put_if_match":
            assert etag is not None
            await target.put_if_match(key, f"worker {worker}".encode(), etag=etag)
        elif op == "delete_if_match":
            assert etag is not None
            return bool(await target.delete_if_match(key, etag=etag))
        elif op == "nonce":
            admission = await target.admit(
                claims=[("race", key)],
                ttl=timedelta(minutes=5),
                now=datetime.now(UTC),
                tenant="t",
                correlation_id=None,
                business_key=None,
            )
            return bool(admission.fresh)
        elif op == "lease":
            now = datetime.now(UTC)
            lease = await target.acquire_lease(
                name=key, owner=f"w{worker}", ttl=timedelta(minutes=5), now=now
            )
            return lease is not None
        elif op == "idempotency":
            record = await target.claim_idempotency(
                tenant="t",
                key=key,
                fingerprint="fp",
                session_id=f"s{worker}",
                ttl=timedelta(minutes=5),
                now=datetime.now(UTC),
            )
            return bool(record.created)
        elif op == "business_key":
            from torpor.ids import new_correlation_id
            from torpor.ports import WaitBinding

            now = datetime.now(UTC)
            binding = WaitBinding(
                tenant="t",
                correlation_id=new_correlation_id(),
                session_id=f"s{worker}",
                epoch=1,
                step_id="1",
                deadline=now + timedelta(hours=1),
            )
            return bool(
                await target.bind_wait(
                    binding, business_key=key, grace=timedelta(minutes=5), now=now
                )
            )
        else:
            raise ValueError(op)
    except PreconditionFailed:
        return False
    return True


def _worker(
    spec: Spec,
    op: str,
    rounds: int,
    worker: int,
    barrier: Any,
    etags: list[str | None],
    out: Any,
    key_prefix: str,
) -> None:
    async def main() -> None:
        target = _open(spec)
        for r in range(rounds):
            # The first round waits for every spawned worker to import and connect, which
            # takes long on a loaded 2-core machine; later rounds only for the others' tries.
            barrier.wait(timeout=300 if r == 0 else 60)
            # An attempt that hangs leaves every thread's stack on stderr (in the test's
            # report) and exits: a hung race showed only the barrier's EOFError, two
            # minutes later, which said nothing of where the worker was.
            faulthandler.dump_traceback_later(90, exit=True)
            won = await _attempt(target, op, r, worker, etags[r], key_prefix)
            faulthandler.cancel_dump_traceback_later()
            out.put((r, worker, won))
        await target.close()

    try:
        asyncio.run(main())
    except BaseException:
        # The others stop waiting at once, and this worker's own error is what the test
        # reports: before, they waited at the barrier past the test's timeout, and the
        # failure read as the Manager's EOFError two minutes later.
        barrier.abort()
        raise


def race(
    spec: Spec,
    op: str,
    *,
    workers: int,
    rounds: int,
    etags: list[str | None] | None = None,
    key_prefix: str = "race/",
) -> dict[int, list[int]]:
    """Winners per round: {round: [worker, ...]}. Round ``r`` races on the key
    ``{key_prefix}round-{r}``."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(workers)
        out = manager.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(spec, op, rounds, w, barrier, etags or [None] * rounds, out, key_prefix),
            )
            for w in range(workers)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=360)
        codes = [p.exitcode for p in procs]
        if any(code != 0 for code in codes):
            raise RuntimeError(f"race workers failed: exit codes {codes}")
        winners: dict[int, list[int]] = {r: [] for r in range(rounds)}
        while not out.empty():
            r, w, won = out.get()
            if won:
                winners[r].append(w)
        return winners
