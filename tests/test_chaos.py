"""The chaos benchmark as a test: worker processes of every role SIGKILLed mid-run lose no row,
train none twice, the run completes, a resumed controller finishes it, and nothing is left.

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
        if run_id in (proc.info["cmdline"] or []):
            found.append(f"pid {proc.info['pid']}")
    return found


def _assert_sound(out: dict[str, Any]) -> None:
    assert out["completed"], out.get("error")
    assert out["rows_lost"] == 0
    assert out["rows_trained_twice"] == 0
    assert out["clean"], (out["leftovers"], out["resume"])
    assert out["kills"] == len(out["kill_log"]) > 0
    assert out["restarts"] >= out["kills"]
    assert out["worker_deaths"] >= out["kills"]  # a loaded machine may add a missed heartbeat
    for run_id in (out["run_id"], out["resume"].get("run_id")):
        if run_id is not None:
            assert _left_behind(run_id) == []


@pytest.mark.timeout(120)
def test_killing_every_role_mid_run_loses_and_repeats_nothing() -> None:
    # Simulated compute, real processes: one kill of each role, at random moments.
    out = _chaos("--engine", "sim", "--kills", "4", "--steps", "10", "--seed", "3",
                 timeout=110)
    _assert_sound(out)
    assert out["kills_by_role"] == dict.fromkeys(ROLES, 1)
    assert out["resume_ok"], out["resume"]
    assert out["resume"]["redo"] > 0, "the resumed state had positions in flight"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_killed_real_trainer_continues_from_the_published_weights(tmp_path: Path) -> None:
    # The real tiny model (no reference stage and no resume phase, to be quick); seed 0 kills
    # the trainer at version 3, so its step 4 is told apart from one of a trainer restarted
    # from the initial weights.
    out = _chaos("--engine", "tiny", "--kills", "1", "--roles", "train", "--steps", "6",
                 "--seed", "0", "--set", "algorithm.kl_coef=0", "--no-resume", timeout=140,
                 env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    _assert_sound(out)
    assert out["kills_by_role"] == {"train": 1}
    (jump,) = out["trainer_weight_jumps"]
    assert "d_prev" in jump, jump
    # One optimizer step away from the last published weights, far from the initial ones.
    assert jump["d_prev"] < 0.5 * jump["d_init"], jump
    assert out["trainer_weights_continuous"]
