"""`bench/long_polls.py` runs both kinds of long poll on a real server and leaves nothing behind
(its figures are bench/README.md's, not a test's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_benchmark_runs_both_modes_and_cleans_up() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/long_polls.py", "--workers", "8", "--rounds", "2",
         "--blocks", "2"], cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    for mode in ("task", "parked"):
        assert out[f"cpu_us_per_poll_{mode}"] > 0
        assert out[f"pass_us_per_task_{mode}"] > 0
    assert len(out["cpu_us_per_poll_blocks"]) == 2
    assert not list(Path("/tmp").glob("flowrl-*/polls.sock"))  # its run directory is gone
