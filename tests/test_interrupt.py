"""Ctrl-C during a launched run's long stages: the launcher says each stage as it starts, and a
Ctrl-C there stops everything cleanly, exits with 130 and says last what was done and saved.

Each test starts ``python -m flowrl.launch`` in a session of its own and sends SIGINT to the
whole process group, as a terminal does, once the progress line announcing the stage is out.
Fresh cache directories, so the tiny model's build really runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flowrl.resume import STATE_FILE

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/tiny_cpu.py"
SMALL = ["--set", "model.tiny.hidden=32", "--set", "model.tiny.layers=1",
         "--set", "model.tiny.heads=2", "--set", "model.tiny.kv_heads=1",
         "--set", "model.tiny.vocab_size=400", "--set", "trainer.groups_per_step=2",
         "--set", "trainer.micro_batch_groups=1", "--set", "algorithm.group_size=4"]


def _launch(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    with open(tmp_path / "stderr", "w") as err:  # the launcher holds its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "flowrl.launch", RECIPE, "--no-monitor",
             "--output", str(tmp_path / "run"), *SMALL, *args],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
                 "FLOWRL_LOG_FORMAT": "json"})


def _until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    """The launcher's stdout lines up to the first that starts with ``prefix``."""
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return seen
    pytest.fail(f"the launcher exited ({proc.wait()}) before saying {prefix!r}: {seen}")


def _ctrl_c(proc: subprocess.Popen[str], tmp_path: Path) -> tuple[int, list[str], list[str]]:
    """SIGINT to the launcher's process group; its exit code, the rest of its stdout, its
    stderr lines. Fails if a process of the group is left."""
    group = proc.pid
    os.killpg(group, signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(group, signal.SIGKILL)
            proc.wait()
    left = [_described(p) for p in psutil.process_iter() if _group_of(p) == group]
    assert left == [], f"processes of the launcher's group left running: {left}"
    return proc.returncode, rest.splitlines(), (tmp_path / "stderr").read_text().splitlines()


def _described(p: psutil.Process) -> str:
    """A process's pid, state and command line, for a failure's message."""
    try:
        return f"{p.pid} ({p.status()}): {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"{p.pid} (gone)"


def _group_of(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_during_the_tiny_model_build_leaves_nothing_that_looks_built(
        tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--steps", "3")  # the recipe's warm-up: a long build
    seen = _until(proc, "model   building the tiny model")
    code, rest, err = _ctrl_c(proc, tmp_path)
    assert code == 130, err[-20:]
    assert err[-1] == "interrupted while building the tiny model: nothing was trained or saved"
    assert not any("Traceback" in line for line in err), err[-20:]
    assert seen[0] == "data    4096 arithmetic prompts (a+b= with a, b in 0..5)"
    assert rest[0].startswith("stop    stopping while building the tiny model")
    # The child building the model removed its temporary directory; nothing else was made.
    models = tmp_path / "cache" / "flowrl" / "models"
    assert not models.exists() or list(models.iterdir()) == []
    assert not (tmp_path / "run" / "step_1").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_mid_training_stops_cleanly_and_says_the_newest_checkpoint(
        tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--steps", "50", "--set", "model.tiny.pretrain_steps=0",
                   "--set", "checkpoint_every=1")
    seen = _until(proc, "saved   checkpoint of step 1")
    code, rest, err = _ctrl_c(proc, tmp_path)
    assert code == 130, err[-20:]
    out = tmp_path / "run"
    said = re.fullmatch(
        rf"interrupted at step (\d+) of 50: newest checkpoint ({re.escape(str(out))}/step_"
        rf"(\d+)) \(continue with --resume {re.escape(str(out))}\); results in "
        rf"{re.escape(str(out))}", err[-1])
    assert said is not None, err[-1]
    assert 1 <= int(said.group(3)) <= int(said.group(1)) < 50
    assert (Path(said.group(2)) / STATE_FILE).is_file()
    assert not any("Traceback" in line for line in err), err[-20:]
    # What the run said on the way, one stage after another.
    cache = tmp_path / "cache" / "flowrl" / "models"
    (model,) = cache.iterdir()
    assert seen[:3] == [
        "data    4096 arithmetic prompts (a+b= with a, b in 0..5)",
        f"model   building the tiny model into the cache, where later runs find it: {model}",
        "model   tokenizer trained: 258 tokens" + seen[2].partition("tokens")[2]]
    assert any(line.startswith("model   tiny model built in ") for line in seen)
    assert "workers starting 3 workers (rollout, reward, train)" in seen
    assert any(re.fullmatch(r"workers 3 of 3 up in .+ s", line) for line in seen)
    assert re.fullmatch(rf"saved   checkpoint of step 1: {re.escape(str(out))}/step_1 "
                        r"\(\d+\.\d MB, \d+\.\d+ s\)", seen[-1])
    assert any(line.startswith("stop    stopping while training") for line in rest)
    # The run's sockets and shared memory are gone.
    run_ids = {json.loads(line)["run_id"] for line in err
               if line.startswith("{") and '"controller ready"' in line}
    assert len(run_ids) == 1
    (run_id,) = run_ids
    assert not Path(f"/tmp/flowrl-{run_id}").exists()
    assert list(Path("/dev/shm").glob(f"flowrl-{run_id}-*")) == []
