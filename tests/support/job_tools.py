"""A Ray Job as a long-running tool, for the Job tests: a "training run" whose entrypoint is
a small ``python -c`` script. It waits for a gate file (so a test can kill its watcher or
cancel its session meanwhile), then prints its result as one JSON line."""

from __future__ import annotations

import shlex
import sys
from typing import Any

from actors.ray_work import ray_job_tool
from torpor.work import Resources, RetryPolicy

HOLD_LIMIT_S = 120

_SCRIPT = f"""
import json, os, sys, time
gate, corpus = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + {HOLD_LIMIT_S}
while gate and not os.path.exists(gate):
    if time.monotonic() > deadline:
        sys.exit("the gate never opened")
    time.sleep(0.05)
print("RESULT " + json.dumps({{"trained_on": corpus, "pid": os.getpid()}}))
"""


def train_command(args: dict[str, Any]) -> str:
    return shlex.join(
        [sys.executable, "-c", _SCRIPT, str(args.get("gate") or ""), str(args["corpus"])]
    )


train = ray_job_tool(
    "train",
    entrypoint=train_command,
    resources=Resources(num_cpus=0),
    retry=RetryPolicy(max_runs=2),
    expected_duration_s=1.0,  # overdue after 2 s: the reconciler's poll then looks
)


def job_agents() -> dict[str, Any]:
    """Settings fragment: one agent whose only step is the ``train`` job."""
    args = {"corpus": "${input.corpus}", "gate": "${input.gate}"}
    plan = {
        "steps": [
            {"id": "train", "calls": [{"tool": "train", "args": args}], "on_error": "done"},
            {"id": "done", "finish": {"train": "${results.train}"}},
        ]
    }
    return {
        "finetune": {
            "factory": "torpor.agents.plan:PlanAgent",
            "options": {"plan": plan, "name": "finetune", "version": "1"},
            "tools": ["tests.support.job_tools:train"],
        }
    }
