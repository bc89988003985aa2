"""`bench/learning.py` without training: its arguments, its summary, its CPU load, the
evaluation of a policy on the task (`bench/task_accuracy.py`) and the JSON it prints; and, when
TRL is installed, its side of the comparison (`bench/trl_peer.py`)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "learning.py"
_SPEC = importlib.util.spec_from_file_location("bench_learning", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
learning = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_learning"] = learning
_SPEC.loader.exec_module(learning)
# Importable now that loading bench/learning.py put the repository root on the path.
task_accuracy = importlib.import_module("bench.task_accuracy")
trl_peer = importlib.import_module("bench.trl_peer")

pytestmark = pytest.mark.timeout(60)


def test_defaults_and_quick() -> None:
    args = learning.parse([])
    assert (args.seeds, args.modes, args.load_procs, args.steps) == (
        [0, 1, 2, 3, 4], ["quiet", "loaded"], 2, None)
    quick = learning.parse(["--quick"])
    assert quick.seeds == [0]
    assert quick.modes == ["quiet", "loaded"]
    assert learning.parse(["--quick", "--seeds", "3,4", "--modes", "loaded"]).seeds == [3, 4]


@pytest.mark.parametrize("argv", [["--modes", "busy"], ["--seeds", "a"], ["--seeds", "-1"],
                                  ["--load-procs", "-1"], ["--steps", "5"],
                                  ["--eval-samples", "0"], ["--trl-threads", "0"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        learning.parse(argv)
    assert e.value.code == 2


def test_summary_of_hand_made_runs() -> None:
    runs = [
        {"mode": "quiet", "reward_first": 0.4, "reward_final": 0.9, "train_s": 40.0,
         "greedy_exact": 30, "sampled_exact": 0.8, "accuracy_gain_per_min": 1.0},
        {"mode": "quiet", "reward_first": 0.5, "reward_final": 0.8, "train_s": 50.0,
         "greedy_exact": 20, "sampled_exact": 0.6, "accuracy_gain_per_min": 0.5},
        {"mode": "loaded", "reward_first": 0.45, "reward_final": 0.95, "train_s": 90.0,
         "greedy_exact": 34, "sampled_exact": 0.9, "accuracy_gain_per_min": 0.3},
    ]
    out = learning._summary(runs, target=0.85)
    assert (out["greedy_exact_min"], out["greedy_exact_mean"]) == (20, 28.0)
    assert (out["sampled_exact_min"], out["sampled_exact_mean_quiet"]) == (0.6, 0.7)
    assert out["accuracy_gain_per_min_mean"] == pytest.approx(0.6)
    assert out["reward_final_min"] == 0.8
    assert out["reward_final_mean"] == pytest.approx(0.8833, abs=1e-4)
    assert out["reward_first_mean"] == pytest.approx(0.45)
    assert (out["train_s_mean"], out["train_s_max"]) == (60.0, 90.0)
    assert (out["learned"], out["runs_n"]) == (2, 3)
    assert (out["reward_final_min_quiet"], out["reward_final_min_loaded"]) == (0.8, 0.95)


def test_cpu_load_runs_busy_processes_and_stops_them() -> None:
    with learning.cpu_load(2) as pids:
        # By pid, not by command line: `Popen` may return before the kernel has set the new
        # program's arguments, and a command line read then is empty.
        me = psutil.Process()
        assert len(pids) == 2
        assert set(pids) <= {p.pid for p in me.children()}
        spinners = [psutil.Process(pid) for pid in pids]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                p.cpu_times().user > 0.05 for p in spinners):
            time.sleep(0.05)  # waiting on the spinners' CPU time, there is no event for it
        assert all(p.cpu_times().user > 0.05 for p in spinners)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spinners)
    with learning.cpu_load(0):
        assert not psutil.Process().children()


def test_versions_name_the_libraries() -> None:
    assert set(learning.versions()) == {"python", "torch", "transformers", "tokenizers"}


# ---- the evaluation ---------------------------------------------------------------------------

RECIPE = learning.RECIPE


@pytest.fixture(scope="module")
def untrained() -> Path:
    """The default recipe's model before any RL (cached across runs, as the benchmark's)."""
    from flowrl.recipe_file import load_recipe
    from flowrl.run import prepare_model

    model = prepare_model(load_recipe(RECIPE))
    assert model is not None
    return model


def _greedy_exact_by_transformers(model_dir: Path, prompts: list[Any]) -> int:
    """Greedy exact answers counted with transformers' own `generate`, one prompt at a time:
    another implementation than the rollout engine the evaluation uses."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.roles.builtin_rewards import exact_match

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    exact = 0
    for e in prompts:
        ids = torch.tensor([tok(e.prompt).input_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=4, pad_token_id=model.config.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        exact += exact_match(e.prompt, text, answer=e.answer) == 1.0
    return exact


@pytest.mark.timeout(90)  # building the model when it is not cached yet takes most of it
def test_exact_accuracy_of_the_untrained_model(untrained: Path) -> None:
    from flowrl.recipe_file import load_recipe

    recipe = load_recipe(RECIPE)
    prompts = task_accuracy.task_prompts(recipe)
    assert len(prompts) == 36  # a+b= with a, b in 0..5
    assert len({e.prompt for e in prompts}) == 36
    first = task_accuracy.exact_accuracy(untrained, recipe, samples=4)
    assert first["prompts"] == 36
    assert first["samples"] == 4
    assert 0 <= first["greedy_exact"] <= 36
    assert 0.0 <= first["sampled_exact"] <= 1.0
    assert task_accuracy.exact_accuracy(untrained, recipe, samples=4) == first  # deterministic
    assert first["greedy_exact"] == _greedy_exact_by_transformers(untrained, prompts)
    with pytest.raises(ValueError, match="samples"):
        task_accuracy.exact_accuracy(untrained, recipe, samples=0)


def test_final_policy_needs_the_last_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no final checkpoint"):
        learning.final_policy(tmp_path, 12)
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_12" / "config.json").write_text("{}")
    assert learning.final_policy(tmp_path, 12) == tmp_path / "step_12"


def test_schedule_follows_the_recipe() -> None:
    from flowrl.recipe_file import load_recipe

    cosine = trl_peer._schedule(load_recipe(RECIPE))
    assert cosine == {"lr_scheduler_type": "cosine_with_min_lr",
                      "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    flat = load_recipe(RECIPE, ["trainer.lr_schedule=constant", "trainer.warmup_steps=3"])
    assert trl_peer._schedule(flat) == {"lr_scheduler_type": "constant_with_warmup"}


def test_trl_refuses_a_job_it_would_not_reproduce() -> None:
    from flowrl.recipe_file import load_recipe

    trl_peer.check_matchable(load_recipe(RECIPE))
    with pytest.raises(ValueError, match=r"algorithm.name = 'dr_grpo'.*entropy_coef = 0.1"):
        trl_peer.check_matchable(load_recipe(
            RECIPE, ["algorithm.name=dr_grpo", "algorithm.entropy_coef=0.1"]))
    with pytest.raises(ValueError, match=r"algorithm.policy_loss = 'gspo'"):
        trl_peer.check_matchable(load_recipe(RECIPE, ["algorithm.policy_loss=gspo"]))
    with pytest.raises(ValueError, match=r"no multiple of trainer\.micro_batch_groups = 3"):
        trl_peer.check_matchable(load_recipe(RECIPE, ["trainer.micro_batch_groups=3"]))


async def _untrained_as_final(recipe: Any, step_log: Path | None = None) -> dict[str, Any]:
    """Stands in for `learning.train`: a real run's processes take ~40 s to start on busy cores,
    beyond this test's budget (tests/test_launch.py trains for real). It leaves the untrained
    model as the run's final checkpoint, where a real run leaves its policy."""
    from flowrl.run import prepare_model

    model = prepare_model(recipe)
    assert model is not None
    assert recipe.checkpoint_every == recipe.steps  # the benchmark asks for the last step
    await asyncio.to_thread(shutil.copytree, model, recipe.output / f"step_{recipe.steps}")
    return {"reward_first": 0.45, "reward_final": 0.5, "train_s": 30.0, "samples_per_s": 100.0,
            "zero_loss_steps": 0, "flat_groups_final": 0.0}


def _args(*argv: str) -> argparse.Namespace:
    return learning.parse(["--modes", "quiet", "--seeds", "0", "--steps", "10",
                           "--eval-samples", "2", *argv])


@pytest.mark.timeout(90)
async def test_json_carries_the_accuracy_of_each_run(
        untrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learning, "train", _untrained_as_final)
    out = await learning.main_async(_args())
    (run,) = out["runs"]
    initial = out["initial"]
    assert set(initial) == {"greedy_exact", "sampled_exact"}
    # The "trained" policy is the untrained model: the same answers, no gain.
    assert (run["greedy_exact"], run["sampled_exact"]) == (
        initial["greedy_exact"], initial["sampled_exact"])
    assert run["accuracy_gain_per_min"] == 0.0
    assert run["samples_per_s"] == 100.0
    assert out["greedy_exact_min"] == initial["greedy_exact"]
    assert out["eval_samples"] == 2
    assert not any(k.startswith("trl") for k in out)


@pytest.mark.timeout(90)
async def test_vs_trl_without_trl_says_why(
        untrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("trl") is not None:
        pytest.skip("trl is installed here: test_vs_trl_trains_with_trl runs it")
    monkeypatch.setattr(learning, "train", _untrained_as_final)
    out = await learning.main_async(_args("--vs-trl"))
    assert "trl not importable" in out["trl_skipped"]
    assert "trl_runs" not in out
    assert out["runs_n"] == 1


def _without_tests_dir(paths: list[str]) -> list[str]:
    """``paths`` less this directory: with tests/ on the path, tests/vllm passes for the vllm
    package, whose version TRL parses when it loads its trainers."""
    here = Path(__file__).resolve().parent
    return [p for p in paths if Path(p or ".").resolve() != here]


# TRL and transformers warn about their own deprecations, which this suite turns into errors.
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                            "ignore::UserWarning")
@pytest.mark.timeout(120)
async def test_vs_trl_trains_with_trl(untrained: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", _without_tests_dir(sys.path))
    pytest.importorskip("trl")
    monkeypatch.setattr(learning, "train", _untrained_as_final)
    # A step of 2 groups of 4 in 2 micro-batches: TRL's side stays a few seconds long.
    small = ["--set", "algorithm.group_size=4", "--set", "trainer.groups_per_step=2",
             "--set", "trainer.micro_batch_groups=1", "--set", "rollout.groups_per_task=1"]
    out = await learning.main_async(_args("--vs-trl", *small))
    assert "trl_error" not in out, out.get("trl_error")
    (run,) = out["trl_runs"]
    assert 0 <= run["greedy_exact"] <= 36
    assert 0.0 <= run["sampled_exact"] <= 1.0
    # 10 steps of 8 samples; train_s is rounded to 0.1 s, samples_per_s taken before that.
    assert run["train_s"] >= 0.1
    assert 80 / (run["train_s"] + 0.06) <= run["samples_per_s"] <= 80 / (run["train_s"] - 0.06)
    assert {"reward_first", "reward_final", "accuracy_gain_per_min"} <= set(run)
    assert out["trl"]["runs_n"] == 1
    assert set(out["trl_versions"]) >= {"trl", "transformers", "torch"}
    assert out["trl_threads"] == 1
