"""A real run whose reward function fails: every failed sample scores 0 and is counted in the
step log (``reward_failed``, ``reward_failed_<kind>``: the failures among the step's own
samples) and on the launcher's progress line; the run goes on until the function has failed on
more than ``reward.max_failure_share`` of the samples for ``reward.max_failure_steps`` steps in
a row, and then stops with its error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flowrl.controller import Controller, RunError
from flowrl.launch import _format_step
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.tiny_model import build_tiny_model

REWARDS = '''
from fractions import Fraction

def always_raises(prompt, response, answer):
    raise RuntimeError("the grader is down")

def too_big_for_a_float(prompt, response, answer):
    return 10**400 if len(response) % 2 else Fraction(10**400, 7)

def odd_operands_fail(prompt, response, answer):
    if int(prompt.split("+")[0]) % 2:
        raise ValueError("odd operand")
    return 1.0
'''


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fn", "kind"), [("always_raises", "error"),
                                          ("too_big_for_a_float", "invalid")])
async def test_a_reward_function_that_always_fails_is_counted_not_fatal(
    tmp_path: Path, fn: str, kind: str
) -> None:
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    (tmp_path / "rewards.py").write_text(REWARDS)
    steps, group, groups = 2, 2, 2
    r = Recipe(
        steps=steps, model=ModelConfig(path=str(model)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=group),
        reward=RewardConfig(fn=f"{tmp_path / 'rewards.py'}:{fn}"),
        rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=groups),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=60)
    assert out["version"] == steps
    assert out["rows_trained_twice"] == 0
    for entry in ctl.step_log:
        assert entry["reward_mean"] == 0.0
        assert entry["reward_failed"] == group * groups
        assert entry[f"reward_failed_{kind}"] == group * groups
        assert math.isfinite(entry["train_loss"])
        assert _format_step(entry).endswith(f"reward failed {group * groups}")


def _tiny(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    return build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                            vocab_size=300, max_positions=64)


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_reward_function_that_keeps_failing_stops_the_run_with_its_error(
    tmp_path: Path,
) -> None:
    model = _tiny(tmp_path)
    group, groups = 2, 2
    r = Recipe(
        steps=6, model=ModelConfig(path=str(model)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=group),
        reward=RewardConfig(fn=f"{tmp_path / 'rewards.py'}:always_raises",
                            max_failure_steps=2),
        rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=groups),
    )
    async with Controller(r.to_pipeline()) as ctl:
        with pytest.raises(RunError) as failed:
            await ctl.run(steps=6, timeout_s=60)
    assert str(failed.value) == (
        "reward failed on 4 of 4 samples of step 2 (error 4), more than max_failure_share = "
        "0.5 of a step's samples for max_failure_steps = 2 steps in a row (the recipe's "
        "reward.max_failure_share and reward.max_failure_steps); error: RuntimeError: the "
        "grader is down")
    assert [e["reward_failed"] for e in ctl.step_log] == [group * groups] * 2


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_failures_are_counted_for_the_step_that_trains_the_samples(tmp_path: Path) -> None:
    # Rollout runs two versions ahead and a reward task scores two groups, while a step has
    # three: reward tasks hold rows of two steps, and rows of later steps are scored before a
    # step commits. Each step still counts the failures among its own samples, and only them.
    model = _tiny(tmp_path)
    group, groups, steps = 2, 3, 4
    r = Recipe(
        steps=steps, max_staleness=2, model=ModelConfig(path=str(model)),
        data=DataConfig(max_prompt_tokens=16), algorithm=AlgorithmConfig(group_size=group),
        reward=RewardConfig(fn=f"{tmp_path / 'rewards.py'}:odd_operands_fail",
                            max_failure_share=1.0),
        rollout=RolloutConfig(max_new_tokens=4, groups_per_task=2),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=groups),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=60)
    assert out["version"] == steps
    failed = 0
    for entry in ctl.step_log:
        assert entry["samples"] == group * groups
        # A sample scores 1.0 unless its reward failed (then 0.0): its step's failures are
        # exactly its zeros.
        zeros = round(entry["samples"] * (1.0 - entry["reward_mean"]))
        assert entry["reward_failed"] == entry.get("reward_failed_error", 0.0) == zeros
        failed += zeros
    assert failed > 0
