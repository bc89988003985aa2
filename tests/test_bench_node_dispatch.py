"""`bench/node_dispatch.py --polls` hands every task to exactly one waiting poll and prints its
figures (bench/README.md's, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_polls_mode_prints_a_cost_per_task_for_each_count() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/node_dispatch.py", "--polls", "4,64", "--tasks", "200",
         "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr  # it raises if a task went to no poll, or to two
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["agent_us_per_task_4_polls"] > 0
    assert out["agent_us_per_task_64_polls"] > 0
    assert out["agent_task_cost_ratio"] > 0
