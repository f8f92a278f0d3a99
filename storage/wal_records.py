"""The write-ahead log's records (``storage.wal``): how a change is framed in a segment
(length, CRC-32, timestamp, op, key, data), read back up to the first record that is not
whole, and a segment's header, the boot it was written in; and one open segment."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

_SUFFIX = ".log"
_FRAME = struct.Struct("<II")  # the body's length, its CRC-32
_BODY = struct.Struct("<QBH")  # timestamp (ns, CLOCK_MONOTONIC), op, key length


class Op(IntEnum):
    HEADER = 0  # a segment's first record: key = the boot id, data = JSON (pid, created)
    PUT = 1  # the object's whole content
    DELETE = 2
    DURABLE = 3  # flushed in place: nothing to write back, but it overrides older records


@dataclass(frozen=True)
class Record:
    at_ns: int
    op: Op
    key: str
    data: bytes = b""


def encode(record: Record) -> bytes:
    key = record.key.encode()
    body = _BODY.pack(record.at_ns, record.op, len(key)) + key + record.data
    return _FRAME.pack(len(body), zlib.crc32(body)) + body


def decode(buf: bytes | memoryview) -> Iterator[Record]:
    """The records of a segment, in order, up to the first that is not whole: the rest of
    a preallocated segment reads as zeros, and a record torn by a crash fails its CRC."""
    view, at = memoryview(buf), 0
    while at + _FRAME.size <= len(view):
        length, crc = _FRAME.unpack_from(view, at)
        body = view[at + _FRAME.size : at + _FRAME.size + length]
        if length < _BODY.size or len(body) < length or zlib.crc32(body) != crc:
            return
        at_ns, op, key_len = _BODY.unpack_from(body)
        try:
            key = bytes(body[_BODY.size : _BODY.size + key_len]).decode()
            kind = Op(op)
        except (UnicodeDecodeError, ValueError):
            return
        yield Record(at_ns, kind, key, bytes(body[_BODY.size + key_len :]))
        at += _FRAME.size + length


def _header(fd: int) -> str | None:
    """The boot a segment was written in, or None if its header is not whole."""
    first = next(decode(os.pread(fd, 4096, 0)), None)
    return first.key if first is not None and first.op is Op.HEADER else None


@dataclass
class _Segment:
    path: str
    fd: int
    size: int
    used: int
    first_at: float | None = None  # CLOCK_MONOTONIC s of its first record after the header
    # A flush of it failed: nothing more is appended to it. Replay stops at the first
    # record that is not whole, and the records that flush covered may read as zeros
    # after a power cut, so a record after them, flushed later, would be acknowledged
    # and then never replayed.
    failed: bool = False
