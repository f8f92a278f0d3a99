"""Activation requests to pool hosts as Redis lists: ``RPUSH`` in, ``BLPOP`` out.

One list per host. A request is one line, ``session<TAB>reason<TAB>requested_at<TAB>
traceparent``; a host blocks on its list and wakes as soon as a request lands, without a
Ray call on either side. A list is capped (``MAX_WAITING``, oldest dropped): a host that
is gone for good must not grow its list for ever, and every dropped request is one a
wake or retry timer brings back (``torpor.ports.activation.ActivationQueue``).
"""

from __future__ import annotations

import asyncio
import logging

from storage.redis_index.connection import REDIS_TIMEOUT_S, RedisConnection, text, translate
from torpor.ports import Reason, Wanted

log = logging.getLogger(__name__)

MAX_WAITING = 100_000
# A blocking pop must return before the connection's own deadline calls it dead.
MAX_WAIT_S = REDIS_TIMEOUT_S / 2


def encode(wanted: Wanted) -> str:
    return "\t".join(
        (
            wanted.session_id,
            wanted.reason.value,
            repr(wanted.requested_at),
            wanted.traceparent or "",
        )
    )


def decode(line: str) -> Wanted | None:
    """None for a line this version cannot read (logged, dropped: its timer recovers it)."""
    try:
        session_id, reason, at, traceparent = line.split("\t")
        return Wanted(session_id, Reason(reason), float(at), traceparent or None)
    except ValueError:
        log.warning("dropped an unreadable activation request %r", line[:200])
        return None


class RedisActivationQueue(RedisConnection):
    @translate
    async def push(self, channel: str, wanted: Wanted) -> int:
        key = self.keys.activations(channel)
        # Both in the webhook path's next batch (``pipelining``), one round trip: every
        # resumed webhook sends one of these. Not a transaction, as before: a trim that
        # fails leaves a list one longer, capped by the next push.
        waiting, _ = await asyncio.gather(
            self.batched("RPUSH", key, encode(wanted)),
            self.batched("LTRIM", key, -MAX_WAITING, -1),
        )
        return min(int(waiting), MAX_WAITING)

    @translate
    async def pop(self, channel: str, *, wait_s: float) -> list[Wanted]:
        # BLPOP's timeout is whole seconds on old servers; at least 1 (0 blocks for ever).
        wait = max(1, min(int(wait_s), int(MAX_WAIT_S)))
        found = await self._redis.blpop([self.keys.activations(channel)], timeout=wait)
        if found is None:
            return []
        wanted = decode(text(found[1]))
        return [] if wanted is None else [wanted]

    async def close(self) -> None:
        self._pipelined.close()  # its own lean connection; the index owns the client
