"""A batch's results export, encoded: JSONL (one object a line) and Parquet (pyarrow).

Results are arbitrary JSON, which has no fixed Parquet type: the ``result`` column holds
each result as a JSON string, so every batch has the same schema whatever its agent
returns."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from torpor.batches import ResultLine

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


def parquet(lines: list[ResultLine]) -> bytes:
    table = pa.table(
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
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()
