"""SIGINT/SIGTERM during a run: the launcher shuts down in order and leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _flowrl_children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True, check=False).stdout
    return [int(p) for p in out.split()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_stops_everything_cleanly(sig: int, tmp_path: Path) -> None:
    env = {**os.environ, "FLOWRL_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl.launch", str(ROOT / "recipes" / "sim_grpo.py"),
         "--steps", "100000", "--no-monitor", "--output", str(tmp_path / "run")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for first in proc.stdout:  # the first step's line: the run is streaming
            if first.startswith("step"):
                break
        else:
            pytest.fail(f"the run ended early with code {proc.wait()}")
        children = _flowrl_children(proc.pid)
        assert children, "the node agent and workers are running"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    for child in children:
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    run_ids = {json.loads(line)["run_id"] for line in err.splitlines()
               if line.startswith("{") and '"controller ready"' in line}
    assert len(run_ids) == 1, err[-2000:]
    (run_id,) = run_ids
    assert not Path(f"/tmp/flowrl-{run_id}").exists()
    assert list(Path("/dev/shm").glob(f"flowrl-{run_id}-*")) == []
