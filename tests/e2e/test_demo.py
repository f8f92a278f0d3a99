"""The main job, small: the demo end to end on embedded defaults, pooled placement."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torpor.demo.scenario import Story, plan_documents
from torpor.entry.demo import DemoOptions, run_demo, verdict


def test_every_story_appears_in_a_small_batch() -> None:
    plans = plan_documents([f"D-{i}" for i in range(14)], seed=7)
    assert {p.story for p in plans.values()} == set(Story)
    assert any(p.forged for p in plans.values()) and any(p.replay for p in plans.values())


def test_verdict_fails_on_a_wrong_terminal_state() -> None:
    plans = plan_documents(["D-0", "D-1"], seed=1)
    final = {doc: {"state": "COMPLETED", "result": {"decision": "approved"}} for doc in plans}
    stats = {"orders": {}, "withdrawals": {}, "responses": {}, "replans": 0}
    rows, ok = verdict(plans, final, stats, [0], (True, 0))
    assert not ok
    assert any(name == "terminal states" and v == "FAIL" for name, v, _ in rows)


def test_demo_runs_clean_on_embedded_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_demo(
        DemoOptions(documents=14, placement="pooled", sla_s=25.0, state_dir=str(tmp_path / "s"))
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    assert "torpor demo passed" in out
    verdicts = [line.split()[-1] for line in out.splitlines() if "  ok  " in line]
    assert len(verdicts) >= 12, out[-2000:]
    assert not re.search(r"\s{2}FAIL\s{2}", out), out[-3000:]
