"""`bench/capacity.py`'s workload and options (its figures are bench/README.md's, not a test's)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Loaded from its file, as it runs (``bench`` is not an installed package; the script puts the
# repository root on the path itself).
_SPEC = importlib.util.spec_from_file_location("bench_capacity", ROOT / "bench" / "capacity.py")
assert _SPEC is not None
assert _SPEC.loader is not None
capacity = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_capacity"] = capacity
_SPEC.loader.exec_module(capacity)
GROUPS_PER_STEP, workload = capacity.GROUPS_PER_STEP, capacity.workload


def test_the_workload_puts_that_many_groups_in_a_rollout_task() -> None:
    for groups in (1, 4):
        spec, nodes = workload(1024, 8, groups)
        rollout = next(s for s in spec.stages if s.name == "rollout")
        assert rollout.micro_batch == groups
        assert nodes == ("node0", *(f"n{i}" for i in range(1, 8)))
        counts = {p.role: p.count for p in spec.pools}
        assert counts == {"rollout": 1024 - 64 - 1, "reward": 64, "train": 1}


@pytest.mark.timeout(60)
def test_a_rollout_group_count_out_of_range_is_refused() -> None:
    for bad in ("0", str(GROUPS_PER_STEP + 1)):
        proc = subprocess.run([sys.executable, "bench/capacity.py", "--rollout-groups", bad],
                              cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 2
        assert f"--rollout-groups must be 1..{GROUPS_PER_STEP}" in proc.stderr
