"""Resuming after the controller dies: run state bookkeeping, and the launch CLI SIGKILLed
mid-run then continued with ``--resume`` (the simulated resume is in test_controller_sim)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from flowrl.resume import STATE_FILE, RunState, TrainedPositions, latest_checkpoint, write_state

ROOT = Path(__file__).resolve().parents[1]


def test_trained_positions_compact_to_a_prefix() -> None:
    t = TrainedPositions()
    for p in (2, 0, 3):
        assert t.add(p)
    assert not t.add(2)  # twice is refused, not counted
    assert (t.below, t.above, t.count) == (1, {2, 3}, 3)
    assert t.add(1)
    assert (t.below, t.above, t.count) == (4, set(), 4)
    assert 3 in t
    assert 4 not in t


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        latest_checkpoint(tmp_path / "missing")
    for n in (2, 4, 10):
        (tmp_path / f"step_{n}").mkdir()
    write_state(tmp_path / "step_2", RunState(2, 8, [9], 12, 9))
    write_state(tmp_path / "step_4", RunState(4, 16, [], 20, 16))
    # step_10 has no run state: the controller died before committing it.
    path, state = latest_checkpoint(tmp_path)
    assert path == tmp_path / "step_4"
    assert state.version == 4
    assert latest_checkpoint(tmp_path / "step_2")[1].redo() == [8, 10, 11]
    (tmp_path / "step_4" / STATE_FILE).write_text('{"version": -1}')
    with pytest.raises(ValueError, match=STATE_FILE):
        latest_checkpoint(tmp_path)


@pytest.mark.timeout(20)  # the old code allocated until memory ran out on some of these
@pytest.mark.parametrize(
    ("state", "error"),
    [
        pytest.param({"admitted_to": 10**18}, "left to redo", id="huge-redo-range"),
        pytest.param({"trained_below": 10**18}, "past admitted_to", id="below-past-admitted"),
        pytest.param({"admitted_to": 2**70}, "below 2", id="beyond-2-62"),
        pytest.param({"trained_above": list(range(20, 20 + (1 << 20) + 1)),
                      "admitted_to": 1 << 22}, "at most", id="enormous-trained-above"),
        pytest.param({"trained_above": [9, 9]}, "twice", id="duplicate-position"),
        pytest.param({"trained_above": [3]}, "outside", id="position-below-the-prefix"),
        pytest.param({"trained_above": [12]}, "outside", id="position-never-admitted"),
        pytest.param({"groups_trained": 5}, "groups_trained", id="miscounted"),
    ],
)
def test_a_corrupted_state_is_refused_naming_the_file(
    tmp_path: Path, state: dict[str, object], error: str
) -> None:
    step = tmp_path / "step_2"
    step.mkdir()
    write_state(step, RunState(2, 8, [9], 12, 9))
    assert latest_checkpoint(tmp_path)[1].redo() == [8, 10, 11]  # the uncorrupted one is fine
    data = {**json.loads((step / STATE_FILE).read_text()), **state}
    if "trained_above" in state and "groups_trained" not in state:
        data["groups_trained"] = data["trained_below"] + len(data["trained_above"])
    (step / STATE_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=error) as info:
        latest_checkpoint(tmp_path)
    assert str(step / STATE_FILE) in str(info.value)


def test_a_state_of_another_step_is_refused(tmp_path: Path) -> None:
    """A state whose version is not its directory's step (copied from another checkpoint)
    would resume weights of one step with the data positions of another."""
    for n in (2, 4):
        (tmp_path / f"step_{n}").mkdir()
    write_state(tmp_path / "step_2", RunState(2, 8, [], 8, 8))
    write_state(tmp_path / "step_4", RunState(2, 8, [], 8, 8))
    with pytest.raises(ValueError, match=r"version \(2\) is not its checkpoint's step \(step_4\)"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "step_2")[1].version == 2


def test_an_oversized_state_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_bytes(b" " * ((64 << 20) + 1))
    with pytest.raises(ValueError, match="larger than 64 MiB"):
        latest_checkpoint(tmp_path)


def _leftovers_of(run_ids: set[str]) -> set[str]:
    """Shared-memory segments and run directories of these runs that exist now."""
    prefixes = tuple(f"flowrl-{r}" for r in run_ids)
    return ({f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(prefixes)}
            | {f"/tmp/{n}" for n in os.listdir("/tmp") if n.startswith(prefixes)})


def _run_ids(stderr: str) -> set[str]:
    """Run ids named by the launcher's JSON log lines."""
    ids = set()
    for line in stderr.splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("run_id"), str):
                ids.add(record["run_id"])
    return ids


def _steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
@pytest.mark.timeout(560)
def test_sigkilled_launch_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [sys.executable, "-m", "flowrl.launch", "recipes/tiny_cpu.py", "--no-monitor",
            "--steps", "6", "--set", "checkpoint_every=2", "--set", "model.tiny.pretrain_steps=0",
            "--set", "trainer.groups_per_step=4", "--set", "trainer.micro_batch_groups=2",
            "--set", "rollout.groups_per_task=2", "--set", "algorithm.group_size=4"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "FLOWRL_LOG_FORMAT": "json"}
    first = subprocess.Popen([*args, "--output", str(out)], cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert first.stdout is not None
    try:
        for line in first.stdout:  # waits on the run's own progress lines
            if line.startswith("step    3"):
                break
        else:
            pytest.fail(f"the first run ended early with code {first.wait()}")
        children = _children(first.pid)
        # The node agent names the run on its command line (workers name their spec file).
        killed = {cmd[cmd.index("--run-id") + 1] for c in children
                  if "--run-id" in (cmd := c.cmdline())}
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait()
        first.stdout.close()
    # Orphans notice their parent is gone (parent-death signal) and exit.
    _gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
    assert len(killed) == 1
    assert (out / "step_2" / STATE_FILE).is_file()
    # The step log kept every step committed before the kill (a line is flushed before the
    # step's progress line is printed); no final model yet.
    logged = _steps_logged(out)
    assert logged[:3] == [1, 2, 3]
    assert not (out / "final").exists()

    done = subprocess.run([*args, "--resume", str(out)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=360, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {out / 'step_2'} (step 2" in done.stdout
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["3", "4", "5", "6"]
    summary = json.loads(lines[-2])  # the last line says where the model is
    assert summary["version"] == 6
    assert summary["rows_trained_twice"] == 0
    # The killed run's shared memory and run directory were reclaimed by the new start; the new
    # run removed its own.
    resumed = _run_ids(done.stderr)
    assert len(resumed) == 1
    assert resumed != killed
    assert _leftovers_of(killed | resumed) == set()
    assert lines[-1] == f"model saved to {out / 'final'}"
    # One step log across the two controllers: the lines after the checkpoint were redone.
    logged = _steps_logged(out)
    assert logged == [1, 2, 3, 4, 5, 6]
    final = json.loads((out / "step_6" / STATE_FILE).read_text())
    # Every prompt group of the six steps trained exactly once, across the two controllers.
    assert final["trained_below"] == final["groups_trained"] == 6 * 4
    assert final["trained_above"] == []
