"""The README's GPU-tool example runs as written: its two files are taken from the README,
written to a folder and run in a fresh process with its own one-node Ray."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- readme-test: (?P<name>[\w.]+) -->\n```python\n(?P<code>.*?)```", re.S)


def readme_files() -> dict[str, str]:
    return {m["name"]: m["code"] for m in MARKER.finditer((ROOT / "README.md").read_text("utf-8"))}


def test_the_readme_gpu_tool_example_runs_as_written(tmp_path: Path) -> None:
    files = readme_files()
    assert {"ocr_tools.py", "scan.py"} <= set(files), sorted(files)
    for name, code in files.items():
        (tmp_path / name).write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    env.pop("TORPOR_CONFIG", None)
    done = subprocess.run(
        [sys.executable, str(tmp_path / "scan.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("COMPLETED"), done.stdout[-2000:]
    assert "'pages': 3" in last and "'status': 'ok'" in last, last
