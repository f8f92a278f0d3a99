"""Ray Data in, Ray Data out: the README's example as written, and documents by reference
(one local Ray for the module, real Redis, the S3 test server)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from tests.conftest import make_bucket
from tests.ray.conftest import ROOT
from tests.support.s3_server import S3TestServer
from torpor.client import DOCUMENT_REF, Client
from torpor.settings import Settings

README = ROOT / "README.md"


def readme_blocks() -> tuple[str, str]:
    """The TOML and Python blocks of the README's "Ray Data" section, as written."""
    text = README.read_text()
    section = text.split("### Ray Data", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert toml and code, "the README's Ray Data section lost its examples"
    return toml.group(1), code.group(1)


@pytest.fixture
def config(
    ray_cluster: None, s3_server: S3TestServer, redis_url: str, redis_prefix: str, tmp_path: Path
) -> Iterator[Path]:
    bucket = "rd-" + secrets.token_hex(4)
    make_bucket(s3_server, bucket)
    kw = s3_server.boto_kwargs()
    toml, _ = readme_blocks()
    path = tmp_path / "torpor.toml"
    path.write_text(
        f'namespace = "rd{secrets.token_hex(4)}"\n'
        + toml
        + f"""
[storage]
object_store_url = "s3://{bucket}/rd"
index_url = "{redis_url}"
redis_prefix = "{redis_prefix}"

[storage.s3]
endpoint_url = "{kw["endpoint_url"]}"
region = "{kw["region"]}"
access_key_id = "{kw["access_key_id"]}"
secret_access_key = "{kw["secret_access_key"]}"

[security]
inline_secrets_in_ray = true

[reconciler]
interval_s = 0.5
wake_grace_s = 2.0
"""
    )
    yield path


def test_the_readme_ray_data_example_runs_as_written(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORPOR_CONFIG", str(config))
    _, code = readme_blocks()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert out.getvalue().strip() == "20 of 20 documents summarised"


def test_documents_by_reference_stay_out_of_the_snapshots(config: Path) -> None:
    settings = Settings.from_env(config_path=str(config))
    rows = [{"id": f"D{i}", "text": "x" * 2000} for i in range(3)]
    with Client(settings, tenant="acme") as client:
        batch = client.submit_dataset(
            ray.data.from_items(rows), agent="summarise", by_reference=True
        )
        results = client.read_results(batch, timeout_s=120).take_all()
        assert sorted(r["state"] for r in results) == ["COMPLETED"] * 3
        for row in sorted(results, key=lambda r: r["index"]):
            result = json.loads(row["result"])
            assert result["id"] == row["document_id"] == f"D{row['index']}"
            # The session saw the reference, not the 2 kB text ...
            assert "xxxx" not in result["summary"]
        docs = [client.get(r["session_id"]) for r in results]
        assert all(d.state.value == "COMPLETED" for d in docs)

        # ... which the reference gives back whole.
        async def inputs() -> list[object]:
            snaps = [await client._async._control.get(r["session_id"]) for r in results]
            return [s.input for s in snaps]

        got = client._call(inputs())
        refs = [i[DOCUMENT_REF] for i in got if isinstance(i, dict)]
        assert len(refs) == 3
        assert sorted(json.dumps(client.read_document(r), sort_keys=True) for r in refs) == sorted(
            json.dumps(r, sort_keys=True) for r in rows
        )
