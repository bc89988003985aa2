"""Progress lines and stops, part by part: throttling, the quiet level, what an interrupted run's
last line says, a data file counted, a forced stop's cleanup. (A launch interrupted for real:
tests/test_interrupt.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.data import scan
from flowrl.interrupts import Interrupts
from flowrl.launch import _interrupted
from flowrl.model_build import _said, cli_args
from flowrl.progress import Progress, megabytes, seconds
from flowrl.recipe_file import load_recipe
from flowrl.resume import STATE_FILE
from transport import shm
from transport.endpoints import ipc_endpoint

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(lines: list[str], clock: Clock) -> Progress:
    return Progress(write=lines.append, every_s=10.0, clock=clock, enabled=True)


def test_a_stage_says_its_start_and_end_and_at_most_one_update_per_interval() -> None:
    lines: list[str] = []
    clock = Clock()
    p = _progress(lines, clock)
    p.begin("model", "building the tiny model", "building")
    for step in range(1, 31):  # a warm-up step every second
        clock.now += 1.0
        p.update(lambda step=step: f"warm-up step {step}")  # type: ignore[misc]
    p.end("built")
    assert lines == ["model   building", "model   warm-up step 10", "model   warm-up step 20",
                     "model   warm-up step 30", "model   built"]
    assert p.doing == "building the tiny model"
    assert p.elapsed() == 30.0
    # forced: said at once (a stage's milestones)
    assert p.update("tokenizer trained", force=True)
    assert lines[-1] == "model   tokenizer trained"


def test_the_stage_column_matches_the_step_lines() -> None:
    lines: list[str] = []
    p = _progress(lines, Clock())
    p.line("workers", "3 of 3 up in 2.0 s")
    p.line("data", "36 prompts")
    assert lines == ["workers 3 of 3 up in 2.0 s", "data    36 prompts"]
    assert lines[1].index("36") == len("step    ")  # where the step lines' number starts


@pytest.mark.parametrize(("level", "said"), [("warning", False), ("error", False),
                                             ("info", True), ("debug", True)])
def test_a_quiet_log_level_silences_progress(monkeypatch: pytest.MonkeyPatch, level: str,
                                             said: bool) -> None:
    monkeypatch.setenv("FLOWRL_LOG_LEVEL", level)
    lines: list[str] = []
    Progress(write=lines.append).line("data", "36 prompts")
    assert bool(lines) is said


def test_figures_read_as_a_person_would_say_them() -> None:
    assert [seconds(s) for s in (0.043, 4.24, 12.4, 185.0)] == [
        "0.04 s", "4.2 s", "12 s", "3 min 05 s"]
    assert megabytes(3_412_000) == "3.4 MB"
    assert megabytes(2_500_000_000) == "2.50 GB"


def test_a_save_is_said_with_its_size_and_time_and_kept(tmp_path: Path) -> None:
    lines: list[str] = []
    p = _progress(lines, Clock())
    p.saved("checkpoint", 4, tmp_path / "step_4", 3_400_000, 0.52)
    assert lines == [f"saved   checkpoint of step 4: {tmp_path / 'step_4'} (3.4 MB, 0.52 s)"]
    assert [s.path for s in p.saves] == [tmp_path / "step_4"]


def test_a_data_file_is_counted_through_with_progress(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    good = json.dumps({"prompt": "1+1=", "answer": 2})
    rows.write_text("".join(f"{good}\n" for _ in range(25)) + "not json\n{}\n")
    seen: list[int] = []
    assert scan(rows, kind="jsonl", every=10, seen=seen.append) == (25, 2)
    assert seen == [10, 20]
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="no usable example"):
        scan(tmp_path / "bad.jsonl", kind="jsonl")


def test_a_build_childs_json_lines_become_progress_lines() -> None:
    lines: list[str] = []
    clock = Clock()
    p = _progress(lines, clock)
    p.begin("model", "building the tiny model", "building")
    clock.now += 3.0
    assert _said(p, json.dumps({"stage": "tokenizer", "tokens": 258}), "tiny model", 30)
    assert _said(p, json.dumps({"stage": "model", "parameters": 912_000}), "tiny model", 30)
    assert not _said(p, "Traceback (most recent call last):", "tiny model", 30)
    assert lines[1:] == ["model   tokenizer trained: 258 tokens (3.0 s)",
                         "model   tiny model made: 0.91M parameters (3.0 s); 30 warm-up steps "
                         "next"]
    # A warm-up with a target says what the model knows at each check, at once.
    assert _said(p, json.dumps({"stage": "model", "parameters": 912_000}), "tiny model", 4000,
                 at_most=True)
    assert lines[-1].endswith("; at most 4000 warm-up steps next")
    assert _said(p, json.dumps({"stage": "warmup", "step": 100, "steps": 4000, "known": 0.25}),
                 "tiny model", 4000)
    assert lines[-1] == ("model   warm-up step 100 of at most 4000: 25% of the corpus's "
                         "questions answered (3.0 s)")
    assert cli_args({"hidden": 32, "kv_heads": 1, "corpus_kind": "arithmetic",
                     "pretrain_until": None}) == [
        "--hidden", "32", "--kv-heads", "1", "--corpus", "arithmetic"]


def _recipe(out: Path, every: int = 2) -> object:
    return load_recipe(str(ROOT / "recipes" / "tiny_cpu.py"),
                       [f"output={out}", f"checkpoint_every={every}", "steps=10"])


def _checkpoint(out: Path, step: int, *, complete: bool) -> None:
    (out / f"step_{step}").mkdir(parents=True)
    if complete:
        (out / f"step_{step}" / STATE_FILE).write_text("{}")


def test_an_interrupted_runs_last_line_says_what_it_did_and_saved(tmp_path: Path) -> None:
    out = tmp_path / "run"
    recipe = _recipe(out)
    p = Progress(enabled=False)
    p.steps = 10
    stop = Interrupts()
    stop.stopping = True
    p.doing = "building the tiny model"
    assert _interrupted(p, recipe, stop) == (  # type: ignore[arg-type]
        "interrupted while building the tiny model: nothing was trained or saved")
    p.doing, p.step = "training", 5
    _checkpoint(out, 2, complete=True)
    _checkpoint(out, 4, complete=True)
    _checkpoint(out, 6, complete=False)  # written, its step not committed: not complete
    assert _interrupted(p, recipe, stop) == (  # type: ignore[arg-type]
        f"interrupted at step 5 of 10: newest checkpoint {out / 'step_4'} (continue with "
        f"--resume {out}); results in {out}")
    stop.forced = True
    assert _interrupted(p, recipe, stop).startswith(  # type: ignore[arg-type]
        "stopped at once at step 5 of 10: newest checkpoint")
    without = _recipe(tmp_path / "other", every=0)
    (tmp_path / "other").mkdir()
    assert _interrupted(p, without, stop).endswith(  # type: ignore[arg-type]
        "no checkpoint saved (checkpoint_every is 0); results in " + str(tmp_path / "other"))


def test_a_forced_stop_kills_the_runs_processes_and_removes_its_shared_memory(
        run_id: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = shm.Owner.current()
    name = f"{shm.owner_prefix(run_id, owner)}{os.getpid()}-0"
    shm.create(name, 4096).close()
    ipc_endpoint(run_id, "ctl")  # the run directory exists
    stop = Interrupts()
    stop.run_ids.add(run_id)
    untrack = stop.track(lambda: [child.pid])
    stop.track(lambda: [])  # a source with nothing running
    try:
        stop.force()
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert shm.segments_of(run_id) == []
        assert not shm.run_dir_path(run_id).exists()
        assert stop.forced
    finally:
        untrack()
        if child.poll() is None:
            child.kill()
            child.wait()
