"""Identifiers and the idempotency keys derived from them.

Random ids come from ``secrets`` so that correlation ids cannot be guessed: a correlation
id is the only thing a callback needs to address a sleeping session, so it carries 128
random bits (the bar is 96).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from functools import lru_cache

from torpor.errors import InvalidRequest

# What may name a thing that becomes part of an object key or Redis key: ASCII letters,
# digits, ``_-.``, 1-128 of them, never ``.`` or ``..``. ``storage.keys.safe`` refuses any
# other; settings hold configured names (webhook sources) to it when they load.
_SAFE_IDENTIFIER = re.compile(r"[A-Za-z0-9_\-.]{1,128}")


def is_safe_identifier(value: str) -> bool:
    # fullmatch: ``$`` would also match before a final line feed.
    return bool(_SAFE_IDENTIFIER.fullmatch(value)) and value not in {".", ".."}


def not_a_name(what: str, value: object) -> str | None:
    """Why ``value`` cannot be ``what`` (a tenant's or a source's name, which name objects
    in storage), or None if it can: the one wording of the alphabet for every check."""
    if isinstance(value, str) and is_safe_identifier(value):
        return None
    return f"{what} {str(value)[:80]!r} is not 1-128 of [A-Za-z0-9_-.] (nor '.' or '..')"


def checked_tenant(tenant: str) -> str:
    """``tenant`` if it is named as the API's tenants are (``Settings.tenants``), else
    ``InvalidRequest``: the tenant names objects in storage, and "" is the session
    registry's "tenant not known" (a session whose snapshot's header did not read)."""
    if problem := not_a_name("tenant", tenant):
        raise InvalidRequest(problem)
    return tenant


CORRELATION_ID_BYTES = 16
MIN_CORRELATION_ID_BITS = 96
_B32 = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford base32, lower case


def _time_prefix(now_ms: int) -> str:
    """10 base32 chars of milliseconds: ids sort by creation time in listings."""
    out = []
    for _ in range(10):
        out.append(_B32[now_ms & 31])
        now_ms >>= 5
    return "".join(reversed(out))


def new_session_id(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    # 10 chars of time + 32 random bits: unique in practice, and creation is create-only,
    # so a collision would fail loudly rather than merge two sessions.
    return "s_" + _time_prefix(ms) + secrets.token_hex(4)


def session_id_ms(session_id: str) -> int | None:
    """The creation time (ms) encoded in a session id; None if it is not one of ours."""
    prefix = session_id[2:12]
    if not session_id.startswith("s_") or len(prefix) != 10:
        return None
    ms = 0
    for char in prefix:
        value = _B32.find(char)
        if value < 0:
            return None
        ms = (ms << 5) | value
    return ms


def batch_session_id(batch_id: str, created_ms: int, index: int, attempt: int = 0) -> str:
    """The session of a batch's document ``index`` (its ``attempt``-th, after retries).

    A function of the batch, not random: a fan-out resumed after a crash, or run twice,
    names the same session again, and the create-only snapshot write makes it once."""
    return (
        "s_"
        + _batch_prefix(created_ms)
        + digest(batch_id, str(index), str(attempt), length=_BATCH_TAIL)
    )


_BATCH_TAIL = 16  # hex digits after the time prefix; a new_session_id has 8


def in_batch(session_id: str) -> bool:
    """Whether ``session_id`` is a batch document's (``batch_session_id``), told by its
    shape alone: every activation asks, and only a batch's sessions take running slots,
    so the others must not pay a round trip to find out."""
    return len(session_id) == 12 + _BATCH_TAIL and session_id.startswith("s_")


@lru_cache(maxsize=64)
def _batch_prefix(created_ms: int) -> str:
    # One batch's ids share it: computed once, not for each of its 10,000 documents.
    return _time_prefix(created_ms)


def new_batch_id(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    return "b_" + _time_prefix(ms) + secrets.token_hex(6)


def new_correlation_id() -> str:
    return secrets.token_urlsafe(CORRELATION_ID_BYTES)


def correlation_id_bits(correlation_id: str) -> int:
    """Entropy a url-safe base64 token of this length can carry (6 bits a character)."""
    return len(correlation_id) * 6


def new_trace_id() -> str:
    """A W3C trace-context trace id (32 lowercase hex, not all zero)."""
    return secrets.token_hex(16)


def new_wait_id() -> str:
    # Unique within its session is enough: it is always looked up with the session id.
    return "w_" + secrets.token_hex(4)


def new_entry_id() -> str:
    return "o_" + secrets.token_hex(8)


def digest(*parts: str, length: int = 32) -> str:
    """Stable hex digest of ``parts`` joined by ':' (the separator is part of the key)."""
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:length]


def tool_call_key(session_id: str, step: int, tool_call_id: str) -> str:
    """``H(session_id:step:tool_call_id)``: the key a sync tool call is logged under.

    The same call replayed after a crash maps to the same key, so it is answered from the
    log instead of being run again; the tool also receives it to dedupe on its side.
    """
    return digest(session_id, str(step), tool_call_id)


def business_idempotency_key(tenant: str, action_key: str, epoch: int, *, reissued: int = 0) -> str:
    """``tenant:action_key:epoch``: what an external system dedupes a dispatched action on.

    A request reissued in its epoch (a fan-in member's next approval stage) is another
    request, so ``reissued`` (how many came before it) names it: ``tenant:action_key#n:
    epoch``. The epoch stays the last part, where ``torpor.work.epoch_of`` reads it."""
    action = f"{action_key}#{reissued}" if reissued else action_key
    return f"{tenant}:{action}:{epoch}"


def event_key(source: str, event_id: str, *, producer: str | None = None) -> str:
    """Inbox key of a delivery: one object per (source, event id) whatever the sender;
    per (source, producer, event id) for a CloudEvent, whose id is unique only within
    its own ``source`` attribute (``producer``): a relay forwarding two producers through
    one torpor source may carry the same id from each. The producer goes in with its
    length, so no split of one text into producer and id names another's key."""
    if producer is None:
        return digest(source, event_id)
    return digest(source, f"{len(producer)}/{producer}", event_id)
