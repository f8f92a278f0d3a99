"""Every object path and Redis key torpor uses, built here and nowhere else.

Identifiers that end up in paths are validated against a safe alphabet first, so no
caller can smuggle ``..`` or a separator into a key.
"""

from __future__ import annotations

import re
import zlib

from torpor.errors import InvalidKey
from torpor.ids import digest, is_safe_identifier
from torpor.lifecycle import SessionState
from torpor.ports import TimerKind

# Matched whole (``fullmatch``): ``$`` would also match before a final line feed.
_KEY = re.compile(r"[A-Za-z0-9_\-.=/]{1,1024}")
# The longest file name a folder holds (NAME_MAX): the local store keeps a key's parts as
# folder and file names, and a key every store holds alike is one it can hold too.
_PART_MAX = 255
_NOT_PARTS = frozenset(("", ".", ".."))  # a folder's own names, or nothing between slashes


def safe(value: str, what: str = "identifier") -> str:
    if not is_safe_identifier(value):
        raise InvalidKey(f"{what} {value[:80]!r} is not a safe identifier ([A-Za-z0-9_-.], 1-128)")
    return value


def check_object_key(key: str) -> str:
    """Refuse keys a local folder or S3 would interpret differently."""
    parts = key.split("/")  # checked by C-level calls: four keys a webhook
    if (
        not _KEY.fullmatch(key)
        or not _NOT_PARTS.isdisjoint(parts)
        or max(map(len, parts)) > _PART_MAX
    ):
        raise InvalidKey(f"object key {key[:120]!r} is not a valid relative key")
    return key


# --- object store paths --------------------------------------------------------------

SNAPSHOTS = "snapshots/"


def snapshot(session_id: str) -> str:
    return SNAPSHOTS + safe(session_id, "session id")


def session_id_of_snapshot(key: str) -> str:
    return key.removeprefix(SNAPSHOTS)


LIVE = "live/"
ENDED = "ended/"
# Written once the live and ended markers cover every session in the store (after a
# one-time backfill of sessions stored before markers existed).
MARKERS_COMPLETE = "markers/complete"


def live(session_id: str) -> str:
    """An empty marker per session that has not ended: what repair walks, so its cost
    follows the live sessions, not every session ever created."""
    return LIVE + safe(session_id, "session id")


def ended(day: str, session_id: str) -> str:
    """An empty marker per ended session, under the day it ended (``YYYYMMDD``): what
    retention walks, oldest day first."""
    return f"{ENDED}{safe(day, 'day')}/{safe(session_id, 'session id')}"


def refs_prefix(session_id: str) -> str:
    """Markers naming a session's records that live under other keys (correlation
    records, deliveries), so retention finds them without listing those folders."""
    return f"refs/{safe(session_id, 'session id')}/"


def correlation_ref(session_id: str, correlation_id: str) -> str:
    return f"{refs_prefix(session_id)}c/{safe(correlation_id, 'correlation id')}"


def delivery_ref(session_id: str, tenant: str, delivery_id: str) -> str:
    return f"{refs_prefix(session_id)}d/{safe(tenant, 'tenant')}/{safe(delivery_id, 'delivery id')}"


def work_ref(session_id: str, work_id: str) -> str:
    """Names a work record (``work_prefix``) of the session: its id is a digest of the
    business key, so retention could not find it from the session id otherwise."""
    return f"{refs_prefix(session_id)}w/{safe(work_id, 'work id')}"


def chunk_prefix(session_id: str) -> str:
    return f"chunks/{safe(session_id, 'session id')}/"


def chunk(session_id: str, kind: str, seq: int, content_digest: str) -> str:
    """One immutable chunk of a session's history: named by its position and content, so
    a retry after a crash writes the very same object (create-only finds it there)."""
    return f"{chunk_prefix(session_id)}{safe(kind, 'chunk kind')}/{seq:06d}-{safe(content_digest)}"


def inbox_prefix(session_id: str) -> str:
    return f"inbox/{safe(session_id, 'session id')}/"


def inbox_event(session_id: str, event_key: str) -> str:
    return inbox_prefix(session_id) + safe(event_key, "event key")


REPLAYS = "replays/"


def accepted_content(source: str, content_digest: str) -> str:
    """The replay marker of one accepted webhook: its source and signed-content digest."""
    return f"{REPLAYS}{safe(source, 'source')}/{safe(content_digest, 'content digest')}"


def accepted_content_parts(key: str) -> tuple[str, str]:
    """The source and content digest a listed ``accepted_content`` names; ``InvalidKey``
    for a key under ``REPLAYS`` that ``accepted_content`` would not have made."""
    source, _, content_digest = key.removeprefix(REPLAYS).partition("/")
    if not key.startswith(REPLAYS) or accepted_content(source, content_digest) != key:
        raise InvalidKey(f"{key[:120]!r} names no replay marker")
    return source, content_digest


REPLAYS_DUE = "replays-due/"
# Written once every replay marker stored before ``replay_due`` entries existed has one
# (or is gone): retention's one-time pass over ``REPLAYS`` is never made again.
REPLAYS_LISTED = "markers/replays-listed"


def replay_due(hour: str, source: str, content_digest: str) -> str:
    """An empty entry per stamped replay marker that no inbox event names, under the hour
    it was stamped (``YYYYMMDDHH``, UTC): what retention walks, oldest hour first,
    stopping at the first hour not yet due, so a sweep with nothing to delete reads no
    marker. (A marker an event names goes with the event's session.)"""
    return (
        f"{REPLAYS_DUE}{safe(hour, 'hour')}/{safe(source, 'source')}/"
        f"{safe(content_digest, 'content digest')}"
    )


def replay_due_parts(key: str) -> tuple[str, str, str]:
    """The hour, source and content digest a listed ``replay_due`` names; ``InvalidKey``
    for a key under ``REPLAYS_DUE`` that ``replay_due`` would not have made."""
    hour, _, rest = key.removeprefix(REPLAYS_DUE).partition("/")
    source, _, content_digest = rest.partition("/")
    if not key.startswith(REPLAYS_DUE) or replay_due(hour, source, content_digest) != key:
        raise InvalidKey(f"{key[:120]!r} names no replay marker's due entry")
    return hour, source, content_digest


def correlation(correlation_id: str) -> str:
    return "correlations/" + safe(correlation_id, "correlation id")


def business_key(tenant: str, key: str) -> str:
    return f"business-keys/{safe(tenant, 'tenant')}/{digest(key)}"


SUBMIT_KEYS = "submit-keys/"


def submit_key(tenant: str, key_digest: str) -> str:
    """The durable record of a submit's Idempotency-Key (its digest: the key is the
    caller's and may hold anything): which session it made, so a retry after the index
    was lost finds that session instead of making a second one."""
    return f"{SUBMIT_KEYS}{safe(tenant, 'tenant')}/{safe(key_digest, 'key digest')}"


def submit_key_parts(key: str) -> tuple[str, str]:
    """The tenant and key digest a listed ``submit_key`` names; ``InvalidKey`` for a key
    under ``SUBMIT_KEYS`` that ``submit_key`` would not have made (a stray object)."""
    tenant, _, digest = key.removeprefix(SUBMIT_KEYS).partition("/")
    if not key.startswith(SUBMIT_KEYS) or submit_key(tenant, digest) != key:
        raise InvalidKey(f"{key[:120]!r} names no submit-key record")
    return tenant, digest


def submit_key_ref(session_id: str, tenant: str, key_digest: str) -> str:
    """Names the session's submit-key record, for retention (``refs_prefix``)."""
    return f"{refs_prefix(session_id)}i/{safe(tenant, 'tenant')}/{safe(key_digest, 'key digest')}"


PROBES = "probe/"


def probe(token: str) -> str:
    """A scratch object for the start-up check of conditional writes."""
    return f"{PROBES}{safe(token)}"


AUDIT = "audit/"


def audit_prefix(stream: str) -> str:
    return f"{AUDIT}{safe(stream, 'audit stream')}/"


def audit_record(stream: str, block: int) -> str:
    return f"{audit_prefix(stream)}{block:012d}"


def audit_block_number(key: str) -> int | None:
    """The block a key under a stream's prefix names, or None for one that names none (a
    store's folder marker, a stray object): compaction and ``verify`` leave it alone."""
    tail = key.rsplit("/", 1)[-1]
    return int(tail) if tail.isascii() and tail.isdigit() else None


BATCHES = "batches/"


def batch(batch_id: str) -> str:
    return BATCHES + safe(batch_id, "batch id")


# A batch's other objects live beside its manifest, not under it: on a local folder the
# manifest is a file, which cannot also be a directory.
BATCH_DATA = "batch-data/"


def batch_data(batch_id: str) -> str:
    return f"{BATCH_DATA}{safe(batch_id, 'batch id')}/"


def batch_documents(batch_id: str, fingerprint: str) -> str:
    """The documents of one request: keyed by its fingerprint, so a second request with
    the same Idempotency-Key and other documents never overwrites the first one's."""
    return f"{batch_data(batch_id)}documents-{safe(fingerprint, 'fingerprint')}.json"


def batch_document_ids(batch_id: str, fingerprint: str) -> str:
    """The ids of one request's documents, in order (``batch_documents``' own key): what a
    results export names its lines by, without reading every document for them."""
    return f"{batch_data(batch_id)}ids-{safe(fingerprint, 'fingerprint')}.json"


def batch_cursor(batch_id: str) -> str:
    return batch_data(batch_id) + "fanout"


def batch_cancelled(batch_id: str) -> str:
    return batch_data(batch_id) + "cancelled"


def batch_retries(batch_id: str) -> str:
    return f"{batch_data(batch_id)}retry-"


def batch_retry(batch_id: str, generation: int) -> str:
    return f"{batch_retries(batch_id)}{generation:06d}"


def batch_results(batch_id: str, fmt: str, *, generation: int = 0) -> str:
    """An export written whole, in one format, as exports were before they were paged
    (``batch_export``): read, never written now. As of ``generation`` retries (a retry
    makes the one before it stale); before any retry, the name exports always had."""
    name = "results" if generation == 0 else f"results-{generation:06d}"
    return f"{batch_data(batch_id)}{name}.{safe(fmt, 'format')}"


def _export(batch_id: str, generation: int) -> str:
    return f"{batch_data(batch_id)}export-{generation:06d}/"


def batch_export(batch_id: str, *, generation: int) -> str:
    """The record that the export as of ``generation`` retries is whole (how many pages it
    has): written after its last page (``batch_export_page``), so an export that died
    half-way is not taken for one, and is written again."""
    return _export(batch_id, generation) + "done"


def batch_export_page(batch_id: str, page: int, *, generation: int) -> str:
    """One page of the export's lines (JSONL), in document order."""
    return f"{_export(batch_id, generation)}page-{page:06d}.jsonl"


FANOUTS = "fanouts/"


def fanout(batch_id: str) -> str:
    """An empty marker per batch whose fan-out has not finished: what repair walks to
    give each its FANOUT timer back after the index was lost (the cursor says where the
    fan-out stands, but only the index's timer sends the reconciler to it)."""
    return FANOUTS + safe(batch_id, "batch id")


BATCH_ACCEPTS = "batch-accepts/"


def batch_accepting(batch_id: str) -> str:
    """Written (with the time) before a batch's first document and removed once its
    manifest is: documents whose manifest never came (an accept or a driver that died
    between the two, a batch refused after its rows were stored by reference) are found
    through it, as nothing else names them."""
    return BATCH_ACCEPTS + safe(batch_id, "batch id")


def batch_document(batch_id: str, index: int) -> str:
    """A document passed by reference (``Client.submit_dataset(..., by_reference=True)``)."""
    return f"{batch_data(batch_id)}docs/{index:08d}.json"


def delivery_prefix(tenant: str) -> str:
    return f"deliveries/{safe(tenant, 'tenant')}/"


def delivery(tenant: str, delivery_id: str) -> str:
    return delivery_prefix(tenant) + safe(delivery_id, "delivery id")


def dead_letter_prefix(tenant: str) -> str:
    """Empty marker objects, one per dead delivery, so listing dead letters is O(page)."""
    return f"dead-letters/{safe(tenant, 'tenant')}/"


def dead_letter(tenant: str, delivery_id: str) -> str:
    return dead_letter_prefix(tenant) + safe(delivery_id, "delivery id")


def pending_delivery_prefix(tenant: str) -> str:
    """Empty marker objects, one per delivery still to be attempted, so the repair's
    look for pending deliveries reads those, not every delivery the tenant ever had."""
    return f"pending-deliveries/{safe(tenant, 'tenant')}/"


def pending_delivery(tenant: str, delivery_id: str) -> str:
    return pending_delivery_prefix(tenant) + safe(delivery_id, "delivery id")


def endpoint_state(tenant: str, url: str) -> str:
    return f"endpoints/{safe(tenant, 'tenant')}/{digest(url)}"


def operator_action(action_id: str) -> str:
    """An operator's console action (who, why, what): the audit record holds its hash."""
    return "operator-actions/" + safe(action_id, "action id")


def work_prefix(work_id: str) -> str:
    """Everything recorded about one piece of compute work (``torpor.work``)."""
    return f"work/{safe(work_id, 'work id')}/"


def work_order(work_id: str) -> str:
    return work_prefix(work_id) + "order"


def work_runs_prefix(work_id: str) -> str:
    return work_prefix(work_id) + "runs/"


def work_run(work_id: str, run: int) -> str:
    return f"{work_runs_prefix(work_id)}{run:06d}"


def work_outcome(work_id: str) -> str:
    return work_prefix(work_id) + "outcome"


def work_result(work_id: str) -> str:
    """A result too large for a snapshot, passed to the session by reference."""
    return work_prefix(work_id) + "result"


def work_stopped(work_id: str) -> str:
    return work_prefix(work_id) + "stopped"


def work_lost(work_id: str, run: int) -> str:
    return f"{work_prefix(work_id)}lost/{run:06d}"


def progress_prefix(session_id: str) -> str:
    return f"progress/{safe(session_id, 'session id')}/"


def progress(session_id: str, work_id: str) -> str:
    return progress_prefix(session_id) + safe(work_id, "work id")


# --- Redis keys -----------------------------------------------------------------------

# What a Redis MATCH pattern reads as a glob, escaped where a key's own text holds it.
_GLOB = re.compile(r"[*?\[\]\\]")


# Tenants whose state sets' names are kept (``every_states_sessions``): more than any
# deployment's settings name; past it, names are made at each call, as before.
_TENANTS_REMEMBERED = 1024


class RedisKeys:
    """Redis key names under one prefix (tests use a prefix of their own).

    Bound waits are the index's most numerous entries, so they live as fields of
    bucketed hashes and time-bucketed sorted sets: Redis stores small hashes and sorted
    sets as compact listpacks, which costs a fraction of one top-level key per wait.
    """

    def __init__(
        self, prefix: str = "tp:", *, buckets: int = 512, deadline_shards: int = 128
    ) -> None:
        self.prefix = prefix
        self.buckets = buckets
        self.deadline_shards = deadline_shards
        self._state_sets: dict[str, tuple[str, ...]] = {}

    def _bucket(self, value: str, of: int) -> int:
        return zlib.crc32(value.encode()) % of

    def correlation(self, correlation_id: str) -> str:
        return f"{self.prefix}c:{self._bucket(correlation_id, self.buckets)}"

    def business_key(self, tenant: str, key: str) -> tuple[str, str]:
        """(hash key, field) of a business-key pointer."""
        field = f"{tenant}:{digest(key, length=16)}"
        return f"{self.prefix}b:{self._bucket(field, self.buckets)}", field

    def deadline_set(self, correlation_id: str, hour: int) -> str:
        """The sorted set holding a wait's deadline: its hour, sharded so that even a burst
        of waits due in the same hour stays in small, compact sets."""
        return self.deadline_shard(hour, self._bucket(correlation_id, self.deadline_shards))

    def deadline_shard(self, hour: int, shard: int) -> str:
        return f"{self.prefix}dl:{hour}:{shard}"

    @property
    def deadline_hours(self) -> str:
        return f"{self.prefix}dlh"

    def timers(self, kind: TimerKind) -> str:
        return f"{self.prefix}t:{kind.value}"

    def nonce(self, scope: str, nonce: str) -> str:
        return f"{self.prefix}n:{scope}:{digest(nonce, length=24)}"

    def idempotency(self, tenant: str, key: str) -> str:
        return f"{self.prefix}i:{tenant}:{digest(key)}"

    def lease(self, name: str) -> str:
        return f"{self.prefix}l:{name}"

    def activations(self, channel: str) -> str:
        return f"{self.prefix}aq:{channel}"

    def fence(self, name: str) -> str:
        return f"{self.prefix}lf:{name}"

    @property
    def lease_expiry(self) -> str:
        return f"{self.prefix}le"

    @property
    def session_state(self) -> str:
        return f"{self.prefix}st"

    def sessions(self, tenant: str, state: SessionState | None) -> str:
        return f"{self.prefix}ss:{tenant}:{state.value if state else '*'}"

    def every_states_sessions(self, tenant: str) -> tuple[str, ...]:
        """``sessions(tenant, s)`` for every state, in ``SessionState``'s order: named in
        each of a session's commits (eighteen names and enum reads a resume, made once
        a tenant; a process serves the few its settings name)."""
        named = self._state_sets.get(tenant)
        if named is None:
            named = tuple(self.sessions(tenant, s) for s in SessionState)
            if len(self._state_sets) < _TENANTS_REMEMBERED:
                self._state_sets[tenant] = named
        return named

    @property
    def every_tenants_sessions(self) -> str:
        """A ``SCAN`` pattern matching ``sessions(tenant, None)`` of every tenant (the
        prefix's own glob characters escaped, the set's final ``*`` taken literally)."""
        return _GLOB.sub(r"\\\g<0>", self.prefix) + "ss:*:\\*"

    def tenant_of_sessions(self, key: str) -> str:
        """The tenant whose ``sessions(tenant, None)`` ``key`` is."""
        return key[len(self.prefix) + len("ss:") : -len(":*")]

    @property
    def intact(self) -> str:
        return f"{self.prefix}intact"

    @property
    def repairing(self) -> str:
        return f"{self.prefix}repairing"

    @property
    def last_sweep(self) -> str:
        return f"{self.prefix}last-sweep"

    @property
    def pattern(self) -> str:
        return f"{self.prefix}*"
