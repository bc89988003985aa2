"""Where rewards come from, as a recipe says it: exactly one of a function, a reward model and a
judge, wrong settings refused naming the field before anything starts, and short real runs of
`recipes/tiny_reward_model.py` with its reward model and with a judge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flowrl.recipe import (
    DataConfig,
    JudgeConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    TinyModelConfig,
)
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.run import compile_recipe, run_recipe
from flowrl.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/tiny_reward_model.py"
TINY: dict[str, Any] = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "vocab_size": 300,
                        "max_positions": 64}


def problems(*overrides: str, recipe: str = RECIPE) -> dict[str, str]:
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(ROOT / recipe, list(overrides))
    return dict(excinfo.value.problems)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sources") / "lm", **TINY)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("sources") / "rm", head="score", **TINY)


# ---- one source, named fields --------------------------------------------------------------------


def test_the_default_is_still_the_exact_match_function() -> None:
    spec = Recipe(steps=1).engine_spec().reward
    assert spec.fn == "workers.roles.builtin_rewards:exact_match"
    assert (spec.model, spec.judge) == (None, None)


def test_a_model_or_judge_replaces_the_default_function() -> None:
    r = Recipe(steps=1, reward=RewardConfig(model=RewardModelConfig(path="tiny")))
    assert r.reward.fn is None
    assert r.engine_spec().reward.model is not None
    j = Recipe(steps=1, reward=RewardConfig(judge=JudgeConfig(max_prompt_tokens=64)))
    assert (j.reward.fn, j.engine_spec().reward.judge is not None) == (None, True)


def test_two_sources_or_none_fail_naming_the_field() -> None:
    assert problems("reward.fn=workers.roles.builtin_rewards:exact_match") == {
        "reward.model": "give one reward source, not fn and model"}
    assert problems('reward.judge={"max_prompt_tokens": 64}') == {
        "reward.judge": "give one reward source, not model and judge"}
    assert problems("reward.model=null") == {
        "reward.fn": "no reward: give a function (fn), a reward model (model) or a judge "
                     "(judge)"}
    assert problems("reward.batched=true") == {
        "reward.batched": "applies to fn only; a reward model scores whole reward tasks"}


def test_reward_model_settings_fail_naming_the_field(tmp_path: Path, lm_dir: Path,
                                                     rm_dir: Path) -> None:
    assert problems(f"reward.model.path={tmp_path}") == {
        "reward.model.path": f"{str(tmp_path)!r} is not a model directory (no config.json in it)"}
    # A causal LM is no reward model: it would load with a fresh two-label head.
    assert problems(f"reward.model.path={lm_dir}") == {
        "reward.model.path": f"{str(lm_dir)!r} is a model with 2 labels; a reward model has "
                             "one (num_labels=1)"}
    assert problems("reward.model.max_length=4096") == {
        "reward.model.max_length": "4096 exceeds tiny.max_positions = 512"}
    assert problems("reward.model.tiny.pretrain_steps=10") == {
        "reward.model.tiny.pretrain_steps": "a tiny reward model keeps random weights; it has "
                                            "no language-modelling warm-up"}
    assert problems(f"reward.model.path={rm_dir}", "reward.model.tiny.seed=1") == {
        "reward.model.tiny": f"tiny-model settings given but path is {str(rm_dir)!r}, not 'tiny'"}
    assert problems("reward.model.batch_size=0") == {
        "reward.model.batch_size": "input should be greater than or equal to 1 (got 0)"}
    assert load_recipe(ROOT / RECIPE, [f"reward.model.path={rm_dir}"]).reward.model is not None


def test_judge_settings_fail_naming_the_field(tmp_path: Path) -> None:
    judge = ["reward.model=null"]
    assert problems(*judge, f'reward.judge={{"path": "{tmp_path}"}}') == {
        "reward.judge.path": f"{str(tmp_path)!r} is not a model directory (no config.json in it)"}
    assert problems(*judge, 'reward.judge={"template": "Score {prompt}:"}') == {
        "reward.judge.template": "the judge template must contain {response}"}
    assert problems(*judge, 'reward.judge={"max_prompt_tokens": 64, "max_score": 0}') == {
        "reward.judge.max_score": "0.0 must be finite and above min_score = 0.0"}
    assert problems(*judge, 'reward.judge={"max_prompt_tokens": 64, "parse": "stars"}') == {
        "reward.judge.parse": "input should be 'number' or 'yes_no' (got 'stars')"}
    # The judge is the tiny policy here: its prompt and verdict must fit the model.
    assert problems(*judge, "reward.judge={}") == {
        "reward.judge.max_prompt_tokens": "with max_new_tokens = 8, 1032 tokens exceed the "
        "judge's (the policy's) model.tiny.max_positions = 512"}


def test_a_simulated_run_refuses_a_reward_model() -> None:
    with pytest.raises(ValueError, match=r"reward\.model: simulated reward workers score no "
                                         r"text; a reward model needs rollout.engine"):
        Recipe(steps=1, rollout=RolloutConfig(engine="sim"),
               reward=RewardConfig(model=RewardModelConfig(path="tiny")))


def test_a_bad_reward_model_path_fails_before_any_process_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", RECIPE, "--set",
         f"reward.model.path={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert (f"{RECIPE}: reward.model.path: {str(tmp_path)!r} is not a model directory "
            "(no config.json in it) (after --set") in done.stderr


def test_the_tiny_reward_model_is_built_and_cached(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = TinyModelConfig(**TINY)
    recipe = Recipe(steps=1, model=ModelConfig(tiny=small),
                    data=DataConfig(max_prompt_tokens=16),
                    rollout=RolloutConfig(max_new_tokens=4),
                    reward=RewardConfig(model=RewardModelConfig(path="tiny", tiny=small,
                                                                max_length=32)))
    config = json.loads(json.dumps(compile_recipe(recipe).engine_config))
    policy, rm = Path(config["model"]["path"]), Path(config["reward"]["model"]["path"])
    assert policy != rm  # the same settings, another head: another cache entry
    assert json.loads((rm / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"]
    assert json.loads((policy / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"]
    assert compile_recipe(recipe).engine_config == config  # built once, then reused


# ---- real runs -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the runs below: the policy is built once."""
    return tmp_path_factory.mktemp("cache")


async def _run(cache: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str,
               steps: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    recipe = load_recipe(ROOT / RECIPE, list(overrides))
    log: list[dict[str, Any]] = []
    summary = await run_recipe(recipe, steps=steps, monitor=False, on_step=log.append)
    return summary, log


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_recipe_trains_on_its_reward_model(model_cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    summary, log = await _run(model_cache, monkeypatch, steps=3)
    assert summary["version"] == 3
    assert summary["rows_trained_twice"] == 0
    assert len(log) == 3
    assert all(entry["reward_failed"] == 0 for entry in log)
    # The random reward model's scores, not a function's 0/1: small numbers of either sign.
    means = [entry["reward_mean"] for entry in log]
    assert all(0.0 < abs(x) < 1.0 for x in means), means


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_recipe_with_a_judge_counts_unparsable_verdicts(
    model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Synchronous, so that the failures counted by a step are those of its own rows.
    summary, log = await _run(
        model_cache, monkeypatch, "reward.model=null", "max_staleness=0",
        'reward.judge={"max_prompt_tokens": 96, "default": -0.5}', steps=2)
    assert summary["version"] == 2
    assert summary["rows_trained_twice"] == 0
    rows = 8 * 8  # groups per step x group size
    for entry in log:
        # The random policy as its own judge writes few scores if any: each verdict without
        # one is counted and scores the default (-0.5; a score is 0..1), and the run goes on.
        assert entry["reward_failed"] == entry["reward_failed_unparsable"] > 0
        unparsable = entry["reward_failed"] / rows
        low = -0.5 * unparsable
        assert low - 1e-9 <= entry["reward_mean"] <= low + (1 - unparsable) + 1e-9
