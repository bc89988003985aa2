"""A real run whose reward function fails: the run completes, every failed sample scores 0 and
is counted in the step log (``reward_failed``, ``reward_failed_<kind>``) and on the launcher's
progress line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flowrl.controller import Controller
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
