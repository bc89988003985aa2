"""A worker process that cannot start says why, and the run stops at once with its error; a
process that dies mid-run is named with the last error it printed.

Real controller, node agent and worker processes with a tiny model (built in seconds). The
recipes are compiled without the launcher's input checks (`flowrl.recipe.inputs`), which would
have refused them before anything started: here the errors show only in the workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.controller import Controller, RunError
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.tiny_model import build_tiny_model

REWARDS = '''
import os, pathlib, traceback

# Once a call has crashed the process, the module no longer loads (in the restarted one).
BROKEN = pathlib.Path(__file__).with_name("broken")
if BROKEN.exists():
    raise ImportError("the grader lost its license")

def score(prompt, response, answer):
    return 1.0

def crash(prompt, response, answer):
    try:
        raise RuntimeError("grader state corrupted")
    except RuntimeError:
        traceback.print_exc()
    os._exit(3)

def crash_once_then_fail_to_load(prompt, response, answer):
    BROKEN.touch()
    os._exit(3)
'''


def _recipe(tmp_path: Path, **sections: object) -> Recipe:
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    (tmp_path / "rewards.py").write_text(REWARDS)
    return Recipe.model_validate({
        "steps": 2, "model": ModelConfig(path=str(model)),
        "data": DataConfig(max_prompt_tokens=16), "algorithm": AlgorithmConfig(group_size=2),
        "rollout": RolloutConfig(max_new_tokens=4),
        "trainer": TrainerConfig(lr=1e-4, groups_per_step=2), **sections})


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_worker_that_cannot_load_its_reward_function_stops_the_run_at_once(
        tmp_path: Path) -> None:
    rewards = tmp_path / "rewards.py"
    recipe = _recipe(tmp_path, reward=RewardConfig(fn=f"{rewards}:scorer"))
    ctl = Controller(recipe.to_pipeline(), start_timeout_s=60)
    with pytest.raises(RunError) as failed:
        async with ctl:
            pass
    assert str(failed.value) == (
        f"worker process reward.0 failed to start: RewardFnError: reward function "
        f"'{rewards}:scorer': '{rewards}' has no 'scorer'")
    assert ctl.restarts == 0  # the same start would fail the same way: no restarts


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_dataset_without_usable_rows_stops_the_run_naming_the_file(
        tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    recipe = _recipe(tmp_path, data=DataConfig(kind="jsonl", path=str(rows),
                                               max_prompt_tokens=16))
    ctl = Controller(recipe.to_pipeline(), start_timeout_s=60)
    with pytest.raises(RunError) as failed:
        async with ctl:
            pass
    message = str(failed.value)
    # Rollout and reward workers read the data: the first to say so ends the run.
    assert message.startswith(("worker process rollout.0 failed to start: ValueError: ",
                               "worker process reward.0 failed to start: ValueError: "))
    assert f"{rows}: no usable example" in message
    assert "keys ['question', 'answer']" in message
    assert ctl.restarts == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_process_that_dies_is_named_with_the_traceback_it_printed(
        tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, reward=RewardConfig(fn=f"{tmp_path / 'rewards.py'}:crash"),
                     placement=PlacementConfig(max_restarts=0))
    async with Controller(recipe.to_pipeline(), start_timeout_s=60) as ctl:
        with pytest.raises(RunError) as failed:
            await ctl.run(steps=2, timeout_s=60)
    assert str(failed.value) == (
        "worker process reward.0 died 1 times (last exit code 3: RuntimeError: grader state "
        "corrupted); max_restarts is 0")


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_process_that_came_up_before_is_restarted_when_it_cannot_start_again(
        tmp_path: Path) -> None:
    # It started once, so its failing to start again may not be for good: it is restarted
    # within max_restarts like any death, and the run then stops quoting its start error.
    rewards = tmp_path / "rewards.py"
    recipe = _recipe(tmp_path, reward=RewardConfig(fn=f"{rewards}:crash_once_then_fail_to_load"),
                     placement=PlacementConfig(max_restarts=2))
    async with Controller(recipe.to_pipeline(), start_timeout_s=60) as ctl:
        with pytest.raises(RunError) as failed:
            await ctl.run(steps=2, timeout_s=90)
    assert str(failed.value) == (
        f"worker process reward.0 died 3 times (last exit code 1: RewardFnError: reward "
        f"function '{rewards}:crash_once_then_fail_to_load': cannot load '{rewards}': "
        f"ImportError: the grader lost its license); max_restarts is 2")
    assert ctl.restarts == 2
