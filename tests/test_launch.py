"""The launch CLI end to end: a real run of the default recipe, recipe errors, ``--help``.

Each test starts ``python -m flowrl.launch`` as a subprocess, as a user would. The run builds its
tiny model (no warm-up, so the build takes seconds) in a private cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_cpu.py"


def _launch(*args: str, env: dict[str, str] | None = None,
            timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowrl.launch", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=timeout, env={**os.environ, **(env or {})}, check=False,
    )


def _records(stderr: str) -> list[dict[str, Any]]:
    """The controller's JSON log lines."""
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _run_ids(stderr: str) -> set[str]:
    """Run ids named by the controller's JSON log lines."""
    return {r["run_id"] for r in _records(stderr) if isinstance(r.get("run_id"), str)}


def _processes_of(run_id: str) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if run_id in cmdline:
            found.append(f"{proc.info['pid']}: {' '.join(cmdline)[:120]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_runs_the_tiny_recipe_and_leaves_nothing_behind(tmp_path: Path) -> None:
    steps = 3
    done = _launch(
        RECIPE, "--steps", str(steps), "--no-monitor", "--output", str(tmp_path / "run"),
        "--set", "model.tiny.pretrain_steps=0",
        "--set", "trainer.groups_per_step=2", "--set", "trainer.micro_batch_groups=1",
        "--set", "algorithm.group_size=4",
        env={"XDG_CACHE_HOME": str(tmp_path / "cache"), "FLOWRL_LOG_FORMAT": "json"},
        timeout=270.0,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == steps, done.stdout
    summary = json.loads(lines[-2])  # the last line says where the model is
    assert summary["version"] == steps
    assert summary["samples"] == steps * 2 * 4
    assert summary["rows_trained_twice"] == 0

    (run_id,) = _run_ids(done.stderr)
    # The controller runs on uvloop, as the workers, the node agents and the benchmarks do.
    assert [r.get("loop") for r in _records(done.stderr) if r.get("event") == "controller ready"
            ] == ["uvloop"]
    assert not Path(f"/tmp/flowrl-{run_id}").exists()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"flowrl-{run_id}")]
    assert _processes_of(run_id) == []
    # The model was built into the private cache, not anywhere else.
    assert list((tmp_path / "cache" / "flowrl" / "models").iterdir())


def test_a_misspelled_override_fails_with_exit_2_naming_field_and_file() -> None:
    done = _launch(RECIPE, "--set", "trainer.lrr=1e-4", timeout=30.0)
    assert done.returncode == 2
    assert "trainer.lrr" in done.stderr
    assert RECIPE in done.stderr
    assert "did you mean 'lr'" in done.stderr
    assert done.stdout == ""


def test_help_answers_at_once() -> None:
    t0 = time.perf_counter()
    done = _launch("--help", timeout=30.0)
    elapsed = time.perf_counter() - t0
    assert done.returncode == 0
    assert "--set" in done.stdout
    assert "--steps" in done.stdout
    # Well under a second on an idle machine; the bound allows for a busy one. It fails if
    # --help pulls in torch or transformers (seconds on their own).
    assert elapsed < 3.0, f"--help took {elapsed:.2f}s"


# ---- inputs the workers could not use fail before anything starts ----------------------------

SMALL_RECIPE = '''
from flowrl import Recipe, TrainerConfig

recipe = Recipe(steps=2, trainer=TrainerConfig(groups_per_step=2))
'''

REWARDS = '''
def score(prompt, response, answer):
    return float(response.strip() == answer)

def two_args(prompt, response):
    return 0.0
'''


def _inputs(tmp_path: Path, case: str) -> tuple[list[str], list[str]]:
    """``--set`` arguments that give the run an input its workers could not use, and what the
    error must say about it."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    if case == "reward":
        return ([f"reward.fn={rewards}:scorer"],
                ["reward.fn", str(rewards), "has no 'scorer'"])
    if case == "reward_args":
        return ([f"reward.fn={rewards}:two_args"],
                ["reward.fn", "two_args", "fn(prompt, response, answer=...)"])
    if case == "data":
        rows = tmp_path / "gsm8k.jsonl"
        rows.write_text("".join(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n"
                                for _ in range(3)))
        return (["data.kind=jsonl", f"data.path={rows}"],
                ["data.path", str(rows), "'prompt'", "keys ['question', 'answer']"])
    model = tmp_path / "model"  # a config, but no tokenizer files
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return [f"model.path={model}"], ["model.path", str(model), "tokenizer"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["reward", "reward_args", "data", "model"])
def test_an_input_the_workers_could_not_use_fails_before_anything_starts(
        tmp_path: Path, case: str) -> None:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(SMALL_RECIPE)
    overrides, expected = _inputs(tmp_path, case)
    done = _launch(str(recipe), "--no-monitor",
                   *(a for o in overrides for a in ("--set", o)), timeout=50.0,
                   env={"XDG_CACHE_HOME": str(tmp_path / "cache"), "FLOWRL_LOG_FORMAT": "json"})
    assert done.returncode == 2, done.stderr[-3000:]
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {recipe}: ")
    for text in expected:
        assert text in error, error
    assert done.stdout == ""
    assert _run_ids(done.stderr) == set()  # no controller started
    assert not (tmp_path / "cache").exists()  # not even the tiny model was built
