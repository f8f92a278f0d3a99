"""deploy/'s Prometheus rules and Grafana dashboard load, and name only real metrics.

Ray exports each torpor metric with its own ``ray_`` prefix (``torpor_x_total`` is
scraped as ``ray_torpor_x_total``; histograms add ``_bucket``/``_sum``/``_count``), so an
expression may name ``ray_<a name in actors.metrics.SPECS>[suffix]`` or a ``torpor:…``
series recorded by the rules. ``promtool check rules`` validates the PromQL when it is
installed (Debian's ``prometheus`` package); the structural check runs always. An
alert's firing is checked with ``promtool test rules`` against series written here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from actors.metrics import SPECS

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "torpor-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "torpor-dashboard.json"
ALERTS = {
    "TorporReconcilerStalled",
    "TorporDeadLetters",
    "TorporSessionsQuarantined",
    "TorporSecurityAlerts",
    "TorporWebhook5xx",
    "TorporOutboxLagHigh",
    "TorporObjectStoreTrouble",
}
SEED_004_RATIOS = {
    "torpor:stale_callback_drop_ratio:rate5m",
    "torpor:dedup_hit_rate:rate5m",
    "torpor:commit_conflict_ratio:rate5m",
    "torpor:outbox_lag_ms:p95_5m",
}
SERIES = re.compile(r"\b(ray_torpor_\w+|torpor:[\w:]+)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def exported() -> set[str]:
    names = set()
    for spec in SPECS.values():
        names.add(f"ray_{spec.name}")
        if spec.kind == "histogram":
            names.update(f"ray_{spec.name}{suffix}" for suffix in HISTOGRAM_SUFFIXES)
    return names


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def unknown_series(expr: str, recorded: set[str]) -> set[str]:
    return {name for name in SERIES.findall(expr) if name not in exported() | recorded}


def test_rules_record_the_seed_ratios_and_alert_on_what_operators_need() -> None:
    all_rules = rules()
    recorded = {r["record"] for r in all_rules if "record" in r}
    alerts = {r["alert"] for r in all_rules if "alert" in r}
    assert recorded >= SEED_004_RATIOS
    assert alerts == ALERTS
    for rule in all_rules:
        assert rule["expr"].strip()
        assert not unknown_series(rule["expr"], recorded), rule
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"]


def test_the_dashboard_imports_and_queries_only_known_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "torpor"
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    recorded = {r["record"] for r in rules() if "record" in r}
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert not {name for expr in exprs for name in unknown_series(expr, recorded)}
    shown = {name for expr in exprs for name in SERIES.findall(expr)}
    assert shown >= SEED_004_RATIOS
    # every metric torpor exports is on the dashboard, directly or through a rule
    through_rules = {
        n for r in rules() if r.get("record") in shown for n in SERIES.findall(r["expr"])
    }
    covered = {re.sub(r"_(bucket|sum|count)$", "", n) for n in shown | through_rules}
    assert {f"ray_{spec.name}" for spec in SPECS.values()} <= covered


def test_the_check_fails_on_a_metric_that_does_not_exist() -> None:
    assert unknown_series("rate(ray_torpor_no_such_metric_total[5m])", set()) == {
        "ray_torpor_no_such_metric_total"
    }
    assert unknown_series("rate(ray_torpor_webhooks_total[5m])", set()) == set()


def promtool(*args: str) -> None:
    """Run promtool (a minute at most); its output is the failure's message."""
    found = shutil.which("promtool")
    # `make test` installs Debian's prometheus (which has promtool) when it is missing.
    assert found is not None, "promtool not found: apt-get install prometheus"
    done = subprocess.run([found, *args], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_rules() -> None:
    promtool("check", "rules", str(RULES))


def alert(name: str) -> dict[str, Any]:
    (rule,) = [r for r in rules() if r.get("alert") == name]
    return rule


def test_a_store_that_no_longer_checkpoints_fires_its_alert_at_the_first_sweep_that_sees_it(
    tmp_path: Path,
) -> None:
    """The reconciler sets ``torpor_object_store_trouble`` at each sweep; a failed flush
    never passes by itself, so one series at 1 fires the alert at once, whatever the
    other processes' series say, with its runbook; all at 0 fire nothing."""
    rule = alert("TorporObjectStoreTrouble")
    fired = {"exp_labels": rule["labels"], "exp_annotations": rule["annotations"]}
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'ray_torpor_object_store_trouble{WorkerId="reconciler"}',
                        "values": "0 0 1 1",
                    },
                    {
                        "series": 'ray_torpor_object_store_trouble{WorkerId="restarted"}',
                        "values": "0 0 0 0",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": rule["alert"], "exp_alerts": []},
                    {"eval_time": "2m", "alertname": rule["alert"], "exp_alerts": [fired]},
                    {"eval_time": "3m", "alertname": rule["alert"], "exp_alerts": [fired]},
                ],
            }
        ],
    }
    tests = tmp_path / "store-trouble.test.yml"
    tests.write_text(yaml.safe_dump(test))
    promtool("test", "rules", str(tests))
