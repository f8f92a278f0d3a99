"""The snapshot codec: compact, versioned, and loud about damage."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.codec import _PREAMBLE, FLAG_ZLIB, MAGIC, MIGRATIONS, SnapshotCodec
from tests.support.factories import busy_snapshot, snapshot
from torpor.errors import SnapshotCorrupt, SnapshotSchemaTooNew
from torpor.models import SCHEMA_VERSION, SessionHeader, SessionSnapshot, WaitingSession


def test_round_trip_is_exact() -> None:
    snap = busy_snapshot()
    codec = SnapshotCodec()
    assert codec.decode(codec.encode(snap)) == snap


def test_header_is_readable_alone() -> None:
    snap = busy_snapshot()
    data = SnapshotCodec().encode(snap)
    header = SnapshotCodec().decode_header(data[:1024])
    assert (header.session_id, header.state, header.epoch) == (snap.session_id, snap.state, 9)


def test_realistic_session_is_at_most_a_quarter_of_its_json() -> None:
    snap = busy_snapshot(200)
    raw = snap.model_dump_json().encode()
    assert len(SnapshotCodec().encode(snap)) <= 0.25 * len(raw)


def test_truncation_anywhere_is_detected() -> None:
    data = SnapshotCodec().encode(busy_snapshot(20))
    for cut in (0, 3, 7, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(SnapshotCorrupt):
            SnapshotCodec().decode(data[:cut])


def test_flipped_body_byte_is_detected() -> None:
    data = bytearray(SnapshotCodec().encode(busy_snapshot(20)))
    data[-10] ^= 0xFF
    with pytest.raises(SnapshotCorrupt):
        SnapshotCodec().decode(bytes(data))


def test_not_a_snapshot() -> None:
    with pytest.raises(SnapshotCorrupt, match="bad magic"):
        SnapshotCodec().decode(b"<html>Access Denied</html>")


def _encode_document(document: dict[str, Any], header: dict[str, Any]) -> bytes:
    head = json.dumps(header).encode()
    return (
        _PREAMBLE.pack(MAGIC, FLAG_ZLIB, len(head))
        + head
        + zlib.compress(json.dumps(document).encode())
    )


def test_newer_schema_is_refused_by_name() -> None:
    snap = snapshot()
    doc = json.loads(snap.model_dump_json())
    doc["schema_version"] = SCHEMA_VERSION + 1
    header = json.loads(
        SnapshotCodec().decode_header(SnapshotCodec().encode(snap)).model_dump_json()
    )
    header["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SnapshotSchemaTooNew, match="upgrade torpor"):
        SnapshotCodec().decode(_encode_document(doc, header))


def test_older_schema_is_migrated_on_load() -> None:
    """A v0 document (the single ``wait`` field of an imagined older format) is upgraded."""
    snap = busy_snapshot(5)
    doc = json.loads(snap.model_dump_json())
    doc["schema_version"] = 0
    doc["wait"] = doc.pop("waits")[0]
    header = json.loads(
        SnapshotCodec().decode_header(SnapshotCodec().encode(snap)).model_dump_json()
    )
    header["schema_version"] = 0

    def v0_to_v1(d: dict[str, Any]) -> dict[str, Any]:
        d["waits"] = [d.pop("wait")] if d.get("wait") else []
        return d

    codec = SnapshotCodec(migrations={**MIGRATIONS, 0: v0_to_v1})
    assert codec.decode(_encode_document(doc, header)) == snap


def test_a_snapshot_of_this_version_is_left_by_a_node_of_the_one_before() -> None:
    """Mid-upgrade, a node still on schema 1 meets a snapshot this version wrote: its
    header holds fields that node's model refuses, so the version must stop it first
    (``SnapshotSchemaTooNew``: left to a newer node) before it calls the snapshot corrupt
    and quarantines a healthy session."""
    data = SnapshotCodec().encode(busy_snapshot(5))
    earlier = SnapshotCodec(current_version=1, migrations={})
    with pytest.raises(SnapshotSchemaTooNew):
        earlier.decode_header(data)
    with pytest.raises(SnapshotSchemaTooNew):
        earlier.decode(data)


def test_a_snapshot_written_at_schema_1_loads() -> None:
    """As 0.3 wrote it: version 1, a header with no trace id and no wait routes."""
    snap = busy_snapshot(5).model_copy(update={"schema_version": 1})
    doc = json.loads(snap.model_dump_json())
    header = json.loads(SessionHeader.of(snap).model_dump_json(exclude={"trace_id", "waits"}))
    loaded = SnapshotCodec().decode(_encode_document(doc, header))
    assert loaded == snap.model_copy(update={"schema_version": SCHEMA_VERSION})
    assert SnapshotCodec().decode_header(_encode_document(doc, header)).waits is None


def test_missing_migration_is_a_clear_error() -> None:
    snap = snapshot()
    doc = json.loads(snap.model_dump_json())
    doc["schema_version"] = 0
    header = json.loads(
        SnapshotCodec().decode_header(SnapshotCodec().encode(snap)).model_dump_json()
    )
    header["schema_version"] = 0
    with pytest.raises(SnapshotCorrupt, match="no migration from schema_version 0"):
        SnapshotCodec(migrations={}).decode(_encode_document(doc, header))


def test_invalid_document_names_the_field() -> None:
    snap = snapshot()
    doc = json.loads(snap.model_dump_json())
    doc["state"] = "NAPPING"
    header = json.loads(
        SnapshotCodec().decode_header(SnapshotCodec().encode(snap)).model_dump_json()
    )
    with pytest.raises(SnapshotCorrupt, match="state"):
        SnapshotCodec().decode(_encode_document(doc, header))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_garbage_never_escapes_as_anything_but_typed_errors(data: bytes) -> None:
    with pytest.raises((SnapshotCorrupt, SnapshotSchemaTooNew)):
        SnapshotCodec().decode(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=255))
def test_any_single_byte_damage_is_caught_or_harmless(position: int, value: int) -> None:
    codec = SnapshotCodec()
    snap = busy_snapshot(10)
    data = bytearray(codec.encode(snap))
    position %= len(data)
    data[position] = value
    try:
        decoded = codec.decode(bytes(data))
    except (SnapshotCorrupt, SnapshotSchemaTooNew):
        return
    # Damage the codec cannot see must at least not produce a different session.
    assert decoded.session_id == snap.session_id and decoded.generation == snap.generation


def test_the_waiting_part_holds_what_the_whole_snapshot_does() -> None:
    codec = SnapshotCodec()
    snap = busy_snapshot(12).model_copy(update={"processed_events": ["e1", "e2"]})
    whole, waiting = codec.decode(codec.encode(snap)), codec.decode_waiting(codec.encode(snap))
    assert waiting.model_dump() == whole.model_dump(include=set(WaitingSession.model_fields))
    assert waiting.waits == snap.waits and waiting.processed_events == ["e1", "e2"]


def test_the_waiting_part_declares_each_field_as_the_snapshot_does() -> None:
    """It repeats a few of the snapshot's fields (a model of its own, so that the others
    are skipped unbuilt): a change to one of them in the snapshot must follow here."""
    for name, part in WaitingSession.model_fields.items():
        whole = SessionSnapshot.model_fields[name]
        assert (part.annotation, part.default, part.default_factory) == (
            whole.annotation,
            whole.default,
            whole.default_factory,
        ), name


def test_the_waiting_part_skips_the_conversation() -> None:
    """Repair's read builds none of it: a message the whole snapshot refuses is not even
    looked at."""
    snap = busy_snapshot(5)
    doc = json.loads(snap.model_dump_json())
    doc["messages"][0]["role"] = "robot"
    data = _encode_document(doc, _header_of(snap))
    with pytest.raises(SnapshotCorrupt, match="messages"):
        SnapshotCodec().decode(data)
    assert SnapshotCodec().decode_waiting(data).waits == snap.waits


def test_a_body_older_than_its_header_says_is_still_migrated() -> None:
    """The one-pass read trusts neither the header's version nor a body that validates
    with the wrong version: either way the body is upgraded first."""
    snap = busy_snapshot(5)
    doc = json.loads(snap.model_dump_json())
    doc["schema_version"] = 0
    doc["wait"] = doc.pop("waits")[0]

    def v0_to_v1(d: dict[str, Any]) -> dict[str, Any]:
        d["waits"] = [d.pop("wait")] if d.get("wait") else []
        return d

    codec = SnapshotCodec(migrations={**MIGRATIONS, 0: v0_to_v1})
    data = _encode_document(doc, _header_of(snap))  # the header says this version
    assert codec.decode(data) == snap
    assert codec.decode_waiting(data).waits == snap.waits


def _header_of(snap: SessionSnapshot) -> dict[str, Any]:
    return json.loads(SnapshotCodec().decode_header(SnapshotCodec().encode(snap)).model_dump_json())


def test_a_body_that_does_not_state_its_version_is_refused() -> None:
    """The one-pass read must not fill the version in from the model's default."""
    snap = snapshot()
    doc = json.loads(snap.model_dump_json())
    del doc["schema_version"]
    data = _encode_document(doc, _header_of(snap))
    for decode in (SnapshotCodec().decode, SnapshotCodec().decode_waiting):
        with pytest.raises(SnapshotCorrupt, match="schema_version missing"):
            decode(data)
