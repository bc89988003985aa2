"""The chaos benchmark as a test: worker processes of every role SIGKILLed or hung (SIGSTOP)
mid-run, and a broadcast subscriber that never reads, lose no row, train none twice, the run
completes, a resumed controller finishes it, and nothing is left.

Each test runs ``bench/chaos.py`` as a subprocess, as a user would, and reads its JSON line;
what a run leaves behind is also looked for here, by the run ids it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"rollout", "reward", "reference", "train"}


def _chaos(*args: str, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "bench/chaos.py", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **(env or {})}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def _left_behind(run_id: str) -> list[str]:
    found = [p for p in (f"/tmp/flowrl-{run_id}",) if Path(p).exists()]
    found += [n for n in os.listdir("/dev/shm") if n.startswith(f"flowrl-{run_id}")]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        # a worker process names its spec file in the run's directory, an agent the run
        if any(run_id in arg for arg in proc.info["cmdline"] or []):
            found.append(f"pid {proc.info['pid']}")
    return found


def _assert_sound(out: dict[str, Any]) -> None:
    assert out["completed"], out.get("error")
    assert out["rows_lost"] == 0
    assert out["rows_trained_twice"] == 0
    assert out["clean"], (out["leftovers"], out["resume"])
    assert out["kills"] == len(out["kill_log"]) > 0
    assert out["stops"] == len(out["stop_log"])
    # Every stopped process was found hung and killed by the controller, not by the bench.
    assert out["stops_unrecovered"] == 0
    assert out["restarts"] >= out["kills"] + out["stops"]
    # a loaded machine may add a missed heartbeat
    assert out["worker_deaths"] >= out["kills"] + out["stops"]
    assert out["hangs_detected"] >= out["stops"]
    for run_id in (out["run_id"], out["resume"].get("run_id")):
        if run_id is not None:
            assert _left_behind(run_id) == []


@pytest.mark.timeout(300)
def test_killing_and_hanging_every_role_mid_run_loses_and_repeats_nothing() -> None:
    # Simulated compute, real processes: one kill of each role and two hangs (SIGSTOP, never
    # resumed) at random moments, and a subscriber that stops reading broadcasts from the start.
    out = _chaos("--engine", "sim", "--kills", "4", "--stops", "2", "--stalls", "1",
                 "--steps", "10", "--seed", "3", timeout=290)
    _assert_sound(out)
    assert out["kills_by_role"] == dict.fromkeys(ROLES, 1)
    assert out["stops"] == 2
    assert out["stalls"] == 1
    for stop in out["stop_log"]:  # found within a heartbeat timeout (2 s), give or take load
        assert stop["detected_s"] < 10, stop
    assert out["resume_ok"], out["resume"]
    assert out["resume"]["redo"] > 0, "the resumed state had positions in flight"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_real_trainer_continues_from_the_published_weights(tmp_path: Path) -> None:
    # The real tiny model (no reference stage, hangs or resume phase, to be quick); seed 0 kills
    # the trainer at version 3, so its step 4 is told apart from one of a trainer restarted
    # from the initial weights.
    out = _chaos("--engine", "tiny", "--kills", "1", "--stops", "0", "--stalls", "0",
                 "--roles", "train", "--steps", "6", "--seed", "0", "--set", "algorithm.kl_coef=0",
                 "--no-resume", timeout=290,
                 env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    _assert_sound(out)
    assert out["kills_by_role"] == {"train": 1}
    (jump,) = out["trainer_weight_jumps"]
    assert "d_prev" in jump, jump
    # One optimizer step away from the last published weights, far from the initial ones.
    assert jump["d_prev"] < 0.5 * jump["d_init"], jump
    assert out["trainer_weights_continuous"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rollout_worker_killed_or_hung_mid_episode_has_its_episodes_redone(
        tmp_path: Path) -> None:
    # The tool recipe's multi-turn episodes (tool sandboxes in the rollout worker's process
    # group): one rollout process killed and one hung while episodes run; each episode it held
    # is run again elsewhere and trained once, and no sandbox outlives its worker.
    out = _chaos("--engine", "tiny", "--recipe", "recipes/tool_cpu.py", "--roles", "rollout",
                 "--kills", "1", "--stops", "1", "--stalls", "0", "--steps", "4", "--seed", "0",
                 "--no-resume", timeout=290, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    _assert_sound(out)
    assert out["kills_by_role"] == {"rollout": 1}
    assert out["stops_by_role"] == {"rollout": 1}
    # a fault landed while the process held rollout tasks, so episodes were cut mid-run
    assert any(f["tasks"] > 0 for f in out["kill_log"] + out["stop_log"]), out
