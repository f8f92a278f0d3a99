"""Snapshot codec: compact, compressed, versioned, and loud about damage.

Layout of an encoded snapshot::

    b"TPS1" | flags:u8 | header_len:u16 | header JSON | zlib(body JSON)

The small uncompressed header (session id, tenant, state, generation, epoch, schema
version) lets repair list sessions by state with a ranged read. The body is the whole
snapshot; zlib's Adler-32 trailer catches corruption and truncation. An older
``schema_version`` is upgraded through the migration registry before validation; a newer
one, or anything that fails to parse, raises a typed error and never a partial object.
"""

from __future__ import annotations

import contextlib
import json
import struct
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import ValidationError

from torpor.errors import SnapshotCorrupt, SnapshotSchemaTooNew
from torpor.models import SCHEMA_VERSION, SessionHeader, SessionSnapshot, WaitingSession

MAGIC = b"TPS1"
FLAG_ZLIB = 0x01
_PREAMBLE = struct.Struct(">4sBH")
# Enough for most headers (ids are short and bounded); one listing a few open waits' routes
# can be longer, and is then read again up to its end.
HEADER_READ_BYTES = 1024
ZLIB_LEVEL = 6

Decoded = TypeVar("Decoded", SessionSnapshot, WaitingSession)
Migration = Callable[[dict[str, Any]], dict[str, Any]]
# version N → function that turns a version-N document into a version-(N+1) document.
MIGRATIONS: dict[int, Migration] = {
    # 1 → 2 changed only the header (new fields, optional): the body is the same.
    1: lambda document: document,
}


class SnapshotCodec:
    def __init__(
        self,
        *,
        current_version: int = SCHEMA_VERSION,
        migrations: Mapping[int, Migration] | None = None,
    ) -> None:
        self.current_version = current_version
        self.migrations = dict(MIGRATIONS if migrations is None else migrations)

    # -- encode ---------------------------------------------------------------------

    def encode(self, snapshot: SessionSnapshot) -> bytes:
        header = SessionHeader.of(snapshot).model_dump_json().encode()
        body = zlib.compress(snapshot.model_dump_json().encode(), ZLIB_LEVEL)
        return _PREAMBLE.pack(MAGIC, FLAG_ZLIB, len(header)) + header + body

    # -- decode ---------------------------------------------------------------------

    @staticmethod
    def header_end(data: bytes) -> int:
        """How many leading bytes hold the preamble and header (``len(data)`` if they do
        not say): a ranged read that got fewer must read again."""
        if len(data) < _PREAMBLE.size:
            return len(data)
        magic, _, header_len = _PREAMBLE.unpack_from(data)
        return _PREAMBLE.size + header_len if magic == MAGIC else len(data)

    def decode_header(self, data: bytes, *, what: str = "snapshot") -> SessionHeader:
        header, _ = self._split(data, what, need_body=False)
        return header

    def decode(self, data: bytes, *, what: str = "snapshot") -> SessionSnapshot:
        return self._decode_as(SessionSnapshot, data, what)

    def decode_waiting(self, data: bytes, *, what: str = "snapshot") -> WaitingSession:
        """The part of the snapshot repair needs (``WaitingSession``), the rest skipped."""
        return self._decode_as(WaitingSession, data, what)

    def _decode_as(self, model: type[Decoded], data: bytes, what: str) -> Decoded:
        header, body = self._split(data, what, need_body=True)
        try:
            raw = zlib.decompress(body)
        except zlib.error as exc:
            raise SnapshotCorrupt(f"{what}: body does not decompress or parse ({exc})") from exc
        decoded: Decoded | None = None
        if header.schema_version == self.current_version:
            # Parsed and validated in one pass by pydantic-core, the fields ``model`` does
            # not name skipped unbuilt: half the time of ``json.loads`` then validating
            # the dict for a whole snapshot. Anything it refuses, or a body of another
            # version than its header says, takes the path below, which says why.
            with contextlib.suppress(ValidationError):
                decoded = model.model_validate_json(raw)
            if decoded is not None and (
                decoded.schema_version != self.current_version
                or "schema_version" not in decoded.model_fields_set  # not its default
            ):
                decoded = None
        if decoded is None:
            decoded = self._validate(model, self._document(raw, what), what)
        if (decoded.session_id, decoded.generation) != (header.session_id, header.generation):
            raise SnapshotCorrupt(f"{what}: header and body disagree on session or generation")
        return decoded

    def _document(self, raw: bytes, what: str) -> dict[str, Any]:
        try:
            document = json.loads(raw)
        except ValueError as exc:
            raise SnapshotCorrupt(f"{what}: body does not decompress or parse ({exc})") from exc
        if not isinstance(document, dict):
            raise SnapshotCorrupt(f"{what}: body is not a JSON object")
        return self._upgrade(document, what)

    @staticmethod
    def _validate(model: type[Decoded], document: dict[str, Any], what: str) -> Decoded:
        try:
            return model.model_validate(document)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SnapshotCorrupt(
                f"{what}: invalid after upgrade at {where or '<root>'}: {first['msg']}"
            ) from exc

    def _split(self, data: bytes, what: str, *, need_body: bool) -> tuple[SessionHeader, bytes]:
        if len(data) < _PREAMBLE.size:
            raise SnapshotCorrupt(f"{what}: {len(data)} bytes is too short to be a snapshot")
        magic, flags, header_len = _PREAMBLE.unpack_from(data)
        if magic != MAGIC:
            raise SnapshotCorrupt(f"{what}: not a torpor snapshot (bad magic)")
        if flags != FLAG_ZLIB:
            raise SnapshotCorrupt(f"{what}: unknown encoding flags {flags:#x}")
        end = _PREAMBLE.size + header_len
        if len(data) < end or (need_body and len(data) == end):
            raise SnapshotCorrupt(f"{what}: truncated")
        try:
            raw = json.loads(data[_PREAMBLE.size : end])
            version = raw.get("schema_version") if isinstance(raw, dict) else None
            if isinstance(version, int) and version > self.current_version:
                raise SnapshotSchemaTooNew(
                    f"{what}: schema_version {version} is newer than this torpor understands "
                    f"({self.current_version}); upgrade torpor before loading it",
                    schema_version=version,
                )
            header = SessionHeader.model_validate(raw)
        except (ValueError, ValidationError) as exc:
            raise SnapshotCorrupt(f"{what}: header is unreadable") from exc
        return header, data[end:]

    def _upgrade(self, document: dict[str, Any], what: str) -> dict[str, Any]:
        version = document.get("schema_version")
        if not isinstance(version, int) or version < 0:
            raise SnapshotCorrupt(f"{what}: schema_version missing or invalid")
        if version > self.current_version:
            raise SnapshotSchemaTooNew(
                f"{what}: schema_version {version} is newer than this torpor understands "
                f"({self.current_version}); upgrade torpor before loading it",
                schema_version=version,
            )
        while version < self.current_version:
            migrate = self.migrations.get(version)
            if migrate is None:
                raise SnapshotCorrupt(f"{what}: no migration from schema_version {version}")
            try:
                document = migrate(dict(document))
            except Exception as exc:
                raise SnapshotCorrupt(
                    f"{what}: migration from schema_version {version} failed: {exc}"
                ) from exc
            version += 1
            document["schema_version"] = version
        return document
