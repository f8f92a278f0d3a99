"""A batch's results export, encoded: JSONL (one object a line) and Parquet (pyarrow),
a page of lines at a time (``PageEncoder``: the export is stored as pages of JSONL and
streamed, so neither its writer nor a reader holds more than a page of it).

Results are arbitrary JSON, which has no fixed Parquet type: the ``result`` column holds
each result as a JSON string, so every batch has the same schema whatever its agent
returns."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from torpor.batches import ResultLine

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

SCHEMA = pa.schema(
    [
        ("index", pa.int64()),
        ("document_id", pa.string()),
        ("session_id", pa.string()),
        ("state", pa.string()),
        ("result", pa.string()),
        ("error", pa.string()),
    ]
)


def jsonl(lines: list[ResultLine]) -> bytes:
    return b"".join(line.model_dump_json().encode() + b"\n" for line in lines)


class PageEncoder(Protocol):
    """An export in one format, encoded a page of JSONL lines at a time: the bytes of
    each page as soon as it is encoded, and what closes the file at the end."""

    def page(self, lines: bytes) -> bytes: ...

    def end(self) -> bytes: ...


class JsonlPages:
    """JSONL is its pages, one after the other."""

    def page(self, lines: bytes) -> bytes:
        return lines

    def end(self) -> bytes:
        return b""


class ParquetPages:
    """One row group a page; the footer (which names every row group) at the end."""

    def __init__(self) -> None:
        self._sink = _Drain()
        self._writer = pq.ParquetWriter(self._sink, SCHEMA)

    def page(self, lines: bytes) -> bytes:
        parsed = [ResultLine.model_validate_json(line) for line in lines.splitlines() if line]
        self._writer.write_table(_table(parsed))
        return self._sink.take()

    def end(self) -> bytes:
        self._writer.close()
        return self._sink.take()


ENCODERS: dict[str, Callable[[], PageEncoder]] = {
    "jsonl": JsonlPages,
    "parquet": ParquetPages,
}


class _Drain(io.RawIOBase):
    """A file the Parquet writer writes to, emptied by ``take``: it holds only what was
    written since. Its position goes on counting (the footer records offsets by it)."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []
        self._at = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._at += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._at

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


def _table(lines: list[ResultLine]) -> pa.Table:
    return pa.table(
        {
            "index": [line.index for line in lines],
            "document_id": [line.document_id for line in lines],
            "session_id": [line.session_id for line in lines],
            "state": [line.state.value if line.state else None for line in lines],
            "result": [None if line.result is None else json.dumps(line.result) for line in lines],
            "error": [line.error for line in lines],
        },
        schema=SCHEMA,
    )
