"""A run's results are kept and said: the output directory's rules (`flowrl.run_output`), and
real launches of the tiny default recipe that write the final model, the recipe, the step log
and the summary, keep the newest checkpoints, refuse another run's directory and check a
resumed recipe; the final model loads with plain transformers and generates.

The launches run in ``tmp_path`` (its own ``runs/``, or ``--output`` there) with a private
model cache shared by this module's tests, so the tiny model is built once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from flowrl.recipe import MonitorConfig, Recipe
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.resume import RunState, prune_checkpoints, write_state
from flowrl.run_output import (
    METRICS_FILE,
    OutputInUse,
    ResumeMismatch,
    RunRecord,
    check_resume,
    claim,
    default_output,
    recipe_record,
    resume_changes,
)
from workers.engines.torch_trainer import portable_tokenizer_config

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "tiny_cpu.py")
# The tiny recipe at test size: no warm-up (the build takes seconds), two groups of four a step.
SMALL = ("--no-monitor", "--set", "model.tiny.pretrain_steps=0",
         "--set", "trainer.groups_per_step=2", "--set", "trainer.micro_batch_groups=1",
         "--set", "algorithm.group_size=4")
TOKEN = "monitor-token-that-must-stay-secret"


# ---- the directory's rules -----------------------------------------------------------------------


def test_the_default_output_is_dated_and_names_recipe_and_run() -> None:
    out = default_output("recipes/tiny_cpu.py", "1a2b3c4d", now=datetime(2026, 12, 1, 9, 5, 7))
    assert out == Path("runs/20261201-090507-tiny_cpu-1a2b3c4d")


def test_the_recipe_record_leaves_the_monitor_token_out() -> None:
    recipe = Recipe(steps=3, monitor=MonitorConfig(token=TOKEN))
    record = recipe_record(recipe)
    assert "token" not in record["monitor"]
    assert TOKEN not in json.dumps(record)
    # Everything else is there, defaults resolved.
    assert record["monitor"]["port"] == recipe.monitor.port
    assert record["trainer"]["lr"] == recipe.trainer.lr
    assert record["algorithm"]["name"] == "grpo"


def _checkpoint(out: Path, step: int, *, complete: bool = True) -> None:
    (out / f"step_{step}").mkdir(parents=True)
    if complete:
        write_state(out / f"step_{step}", RunState(step, step * 2, [], step * 2, step * 2))


def test_a_directory_with_another_runs_results_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    claim(out)  # not there yet: fine
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    claim(out)  # nothing of a run's in it: fine
    _checkpoint(out, 2)
    (out / "final").mkdir()
    (out / METRICS_FILE).write_text("{}\n")
    with pytest.raises(OutputInUse) as info:
        claim(out)
    message = str(info.value)
    assert "\n" not in message
    assert message == (f"output {out} holds another run's results (step_2, final, "
                       f"metrics.jsonl): continue that run with --resume {out}, or replace its "
                       "results with --overwrite")
    claim(out, resume=out)  # continuing that run
    claim(out, resume=out / "step_2")  # from one of its checkpoints
    with pytest.raises(OutputInUse):
        claim(out, resume=tmp_path / "other")  # continuing another run here is not
    assert {p.name for p in out.iterdir()} == {"step_2", "final", METRICS_FILE, "notes.txt"}
    claim(out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # only a run's results go


def test_prune_keeps_the_newest_complete_checkpoints_and_anything_newer(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 5, complete=False)  # written by the trainer, not committed yet
    (tmp_path / "final").mkdir()
    assert prune_checkpoints(tmp_path, 2) == [tmp_path / "step_2", tmp_path / "step_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_3", "step_4", "step_5"]
    assert prune_checkpoints(tmp_path, 2) == []
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / "step_3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step_4", "step_5"]


def test_keep_last_is_checked_naming_the_field() -> None:
    with pytest.raises(RecipeError, match=r"tiny_cpu\.py: keep_last: needs checkpoint_every"):
        load_recipe(RECIPE, ["keep_last=2"])
    with pytest.raises(RecipeError, match=r"keep_last: .*greater than or equal to 1"):
        load_recipe(RECIPE, ["output=x", "checkpoint_every=1", "keep_last=0"])
    assert load_recipe(RECIPE, ["output=x", "checkpoint_every=1", "keep_last=2"]).keep_last == 2


def test_resume_names_every_field_it_cannot_change(tmp_path: Path) -> None:
    saved = load_recipe(RECIPE, [f"output={tmp_path}"])
    changed = load_recipe(RECIPE, [
        f"output={tmp_path / 'elsewhere'}", "steps=400", "trainer.lr=5e-4", "seed=3",
        "algorithm.group_size=4", "algorithm.name=rloo", "model.tiny.hidden=64",
        "data.arithmetic.max_operand=9"])
    fixed, other = resume_changes(recipe_record(saved), recipe_record(changed))
    assert fixed == ["algorithm.group_size (8 → 4)", 'algorithm.name ("grpo" → "rloo")',
                     "data.arithmetic.max_operand (5 → 9)", "model.tiny.hidden (128 → 64)",
                     "seed (0 → 3)"]
    assert other == ["trainer.lr (0.001 → 0.0005)"]  # steps may grow; output is not compared
    (tmp_path / "recipe.json").write_text(json.dumps(recipe_record(saved)))
    with pytest.raises(ResumeMismatch) as info:
        check_resume(tmp_path, changed)
    assert "\n" not in str(info.value)
    assert str(tmp_path / "recipe.json") in str(info.value)
    assert all(f in str(info.value) for f in fixed)
    assert check_resume(tmp_path, saved.model_copy(update={"steps": 500})) == []


def test_the_step_log_is_kept_line_by_line_and_cut_back_on_resume(tmp_path: Path) -> None:
    recipe = Recipe(steps=5, output=tmp_path)
    record = RunRecord(tmp_path, recipe)
    for step in (1, 2, 3):
        record.step({"step": step, "reward_mean": 0.5})
        # Flushed as it goes: a crash keeps every committed step.
        lines = (tmp_path / METRICS_FILE).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == list(range(1, step + 1))
    record.close()
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 4, "rew')  # torn by a crash
    resumed = RunRecord(tmp_path, recipe, resumed_at=2)  # steps 3 and 4 are trained again
    resumed.step({"step": 3, "reward_mean": 0.7})
    summary = resumed.finish({"version": 3, "steps": 1}, [{"step": 3}])
    resumed.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert json.loads(lines[-1])["reward_mean"] == 0.7
    assert summary == {"version": 3, "steps": 1, "output": str(tmp_path), "final_model": None}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_a_tokenizer_only_transformers_5_names_is_saved_portably(tmp_path: Path) -> None:
    file = tmp_path / "tokenizer_config.json"
    file.write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "eos_token": "<e>"}))
    assert portable_tokenizer_config(tmp_path)
    assert json.loads(file.read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<e>",
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False}
    named = {"tokenizer_class": "Qwen2Tokenizer"}  # known to every version: left as it is
    file.write_text(json.dumps(named))
    assert not portable_tokenizer_config(tmp_path)
    assert json.loads(file.read_text()) == named


# ---- real launches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _launch(*args: str, cwd: Path, cache: Path,
            timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowrl.launch", RECIPE, *args], cwd=cwd, capture_output=True,
        text=True, timeout=timeout, check=False,
        env={**os.environ, "XDG_CACHE_HOME": str(cache), "FLOWRL_LOG_FORMAT": "json"})


def _run_ids(stderr: str) -> set[str]:
    ids = set()
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("run_id"), str):
            ids.add(record["run_id"])
    return ids


def _logged(stderr: str, event: str) -> list[dict[str, object]]:
    """The JSON log records of ``event``, with only their own fields."""
    common = {"event", "level", "timestamp", "run_id", "role", "process"}
    found = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append({k: v for k, v in record.items() if k not in common})
    return found


def _steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / METRICS_FILE).read_text().splitlines()]


def _checkpoints(run: Path) -> list[str]:
    return sorted((p.name for p in run.iterdir() if p.name.startswith("step_")),
                  key=lambda n: int(n[5:]))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_launch_keeps_its_final_model_and_says_where(tmp_path: Path, cache: Path) -> None:
    """No output given and checkpoints off: the run still keeps everything under runs/, and
    the model it says it saved loads with plain transformers and generates."""
    done = _launch("--steps", "3", *SMALL, "--set", f"monitor.token={TOKEN}",
                   cwd=tmp_path, cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    said = re.fullmatch(r"model saved to (runs/\d{8}-\d{6}-tiny_cpu-([0-9a-f]{8})/final)",
                        lines[-1])
    assert said is not None, lines[-1]
    assert {said.group(2)} == _run_ids(done.stderr)  # the directory names the run
    final = tmp_path / said.group(1)
    run = final.parent
    assert sorted(p.name for p in run.iterdir()) == [
        "final", "metrics.jsonl", "recipe.json", "summary.json"]  # no checkpoints asked for
    assert list(tmp_path.iterdir()) == [tmp_path / "runs"]

    summary = json.loads(lines[-2])
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["version"] == 3
    assert summary["final_model"] == said.group(1)
    assert _steps_logged(run) == [1, 2, 3]
    recipe = json.loads((run / "recipe.json").read_text())
    assert (recipe["steps"], recipe["trainer"]["groups_per_step"]) == (3, 2)
    assert recipe["output"] == str(run.relative_to(tmp_path))
    for file in run.iterdir():
        if file.is_file():
            assert TOKEN not in file.read_text(), file
    config = json.loads((final / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    prompt = tokenizer("3+4=", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith("3+4=")
    # It is the trained model, not the one the run started from.
    (start,) = (cache / "flowrl" / "models").glob("tiny-*/model.safetensors")
    before, after = load_file(start), load_file(final / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)


KEEPING = (*SMALL, "--set", "checkpoint_every=1", "--set", "keep_last=2")


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Path:
    """A finished three-step run that checkpointed every step and kept the newest two."""
    out = tmp_path_factory.mktemp("checkpointed") / "run"
    done = _launch("--steps", "3", "--output", str(out), *KEEPING, cwd=out.parent, cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == f"model saved to {out / 'final'}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_checkpoints_are_kept_and_a_new_run_may_not_take_them(checkpointed: Path,
                                                              cache: Path) -> None:
    """keep_last keeps the newest checkpoints (portable tokenizer included); a new run in
    the directory, or a resume that changes the model or the group size, is refused before
    anything starts, naming the directory and both ways on, or every field changed."""
    out = checkpointed
    assert _checkpoints(out) == ["step_2", "step_3"]
    assert (out / "final" / "model.safetensors").is_file()
    config = json.loads((out / "step_3" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    logged = (out / METRICS_FILE).read_text()
    assert _steps_logged(out) == [1, 2, 3]

    again = _launch("--steps", "3", "--output", str(out), *KEEPING, cwd=out.parent, cache=cache)
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stdout == ""
    error = again.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: output {out} holds another run's results (step_2, "), error
    assert error.endswith(f"continue that run with --resume {out}, or replace its results with "
                          "--overwrite")

    changed = _launch("--steps", "5", "--resume", str(out), *KEEPING,
                      "--set", "algorithm.group_size=2", "--set", "model.tiny.seed=1",
                      cwd=out.parent, cache=cache)
    assert changed.returncode == 2, changed.stderr[-3000:]
    error = changed.stderr.strip().splitlines()[-1]
    assert "algorithm.group_size (4 → 2)" in error, error
    assert "model.tiny.seed (0 → 1)" in error, error
    # Neither touched the run's results.
    assert _checkpoints(out) == ["step_2", "step_3"]
    assert (out / METRICS_FILE).read_text() == logged


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_resumed_run_grows_changes_its_rate_and_keeps_one_step_log(
    checkpointed: Path, cache: Path, tmp_path: Path,
) -> None:
    """More steps and a lower learning rate resume (the change logged as a warning); the step
    log holds every step once, keep_last goes on, the final model is the new last step's."""
    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    resumed = _launch("--steps", "5", "--resume", str(out), *KEEPING,
                      "--set", "trainer.lr=5e-4", cwd=tmp_path, cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'step_3'} (step 3" in resumed.stdout
    assert _logged(resumed.stderr, "resumed with a changed recipe field") == [
        {"change": "trainer.lr (0.001 → 0.0005)"}]
    lines = resumed.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["4", "5"]
    assert lines[-1] == f"model saved to {out / 'final'}"
    assert json.loads(lines[-2])["version"] == 5
    assert json.loads((out / "summary.json").read_text())["version"] == 5
    assert _steps_logged(out) == [1, 2, 3, 4, 5]
    assert _checkpoints(out) == ["step_4", "step_5"]
    assert json.loads((out / "recipe.json").read_text())["trainer"]["lr"] == 5e-4
    # The final model is step 5's weights (the checkpoint of the same step holds them too).
    from safetensors.torch import load_file

    final, last = load_file(out / "final" / "model.safetensors"), load_file(
        out / "step_5" / "model.safetensors")
    assert final.keys() == last.keys()
    assert all(final[k].equal(last[k]) for k in final)
