"""Simulated multi-turn episodes (`workers.sim_episode`): the real episode rollout role on a
decode loop of modelled cost, its recipe fields, and the agentic benchmark's figures."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from flowrl import RolloutConfig, SimConfig
from flowrl.recipe import Recipe
from workers.roles.episode_rollout import EpisodeRolloutRole
from workers.sim import sim_rollout
from workers.sim_cost import SimCost
from workers.sim_episode import sim_episode_role

# bench/ is not a package on the path: loading bench/agent.py puts the repository root there.
_PATH = Path(__file__).resolve().parents[1] / "bench" / "agent.py"
_SPEC = importlib.util.spec_from_file_location("bench_agent", _PATH)
assert _SPEC is not None
assert _SPEC.loader is not None
agent = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_agent"] = agent
_SPEC.loader.exec_module(agent)

COST = SimCost(prompt_len=5, max_new_tokens=40, log_mean=math.log(8), log_sigma=1.0,
               episode_turns=3, tool_s=0.001, tool_tokens=4, rollout_base_s=0.0,
               rollout_token_s=0.0005)


def _task(rows: int) -> tuple[Any, dict[str, Any]]:
    return ({"task_id": 1, "row_groups": [0] * rows, "params": {}},
            {"prompt": [7] * rows})


async def test_a_simulated_episode_task_writes_trajectories_of_the_cost_model() -> None:
    role = sim_rollout(COST, seed=3)
    assert isinstance(role, EpisodeRolloutRole)
    assert not role.interruptible
    task, inputs = _task(16)
    t0 = time.perf_counter()
    out = await role.run(task, inputs)
    took = time.perf_counter() - t0
    f, met = out.fields, out.metrics
    assert met["episodes"] == 16
    turns, calls = int(met["turns"]), int(met["tool_calls"])
    assert 16 <= turns <= 16 * COST.episode_turns
    assert calls == turns - 16
    assert met["inserted_tokens"] == calls * COST.tool_tokens
    generated = 0
    for ids, mask, versions, prompt in zip(f["response_ids"], f["loss_mask"],
                                           f["token_versions"], f["prompt_ids"], strict=True):
        assert prompt.tolist() == [1] * COST.prompt_len
        assert len(ids) == len(mask) == len(versions)
        generated += int(mask.sum())
        assert versions[mask].tolist() == [0] * int(mask.sum())
        assert versions[~mask].tolist() == [-1] * int((~mask).sum())
    assert generated == met["tokens"]
    # Long-tailed per-turn lengths within the cap: rewards 1 / (1 + generated) differ.
    assert len(set(f["reward"])) > 1
    assert all(0.0 < r < 1.0 for r in f["reward"])
    # The decode loop costs modelled time: at least the longest episode's decode steps.
    longest = max(int(m.sum()) for m in f["loss_mask"])
    assert took >= (longest - 1) * COST.rollout_token_s
    assert met["decode_forwards"] > 0
    assert met["decode_rows"] >= met["decode_forwards"]


def _when_decoding(role: EpisodeRolloutRole, rows: int) -> asyncio.Event:
    """Set (from the batcher's thread) once ``rows`` sequences decode: wraps the modelled
    batch's admit, the one place a sequence joins."""
    event, loop = asyncio.Event(), asyncio.get_running_loop()
    batch = role.batcher._batch
    admit = batch.admit

    def admitted(seqs: Any) -> None:
        admit(seqs)
        if batch.rows == rows:
            loop.call_soon_threadsafe(event.set)

    batch.admit = admitted  # type: ignore[method-assign]
    return event


async def test_a_new_version_continues_running_simulated_episodes_only_with_partial() -> None:
    for partial in (False, True):
        # Long enough (1 s at partial on) that the load lands mid-episode on loaded cores.
        length = 1000 if partial else 50
        cost = SimCost(prompt_len=2, max_new_tokens=length, log_mean=math.log(length),
                       log_sigma=0.0, episode_turns=1, rollout_token_s=0.001, partial=partial)
        role = sim_episode_role(cost, seed=0)
        assert role.interruptible is partial
        task, inputs = _task(2)
        both = _when_decoding(role, 2)
        running = asyncio.create_task(role.run(task, inputs))
        await both.wait()
        weights = {"w": torch.zeros(1)}
        if partial:
            assert await role.load_version(1, weights) == 2  # both continue under it
        out = await running
        if not partial:  # the runtime loads only once the task is done
            assert await role.load_version(1, weights) == 0
        versions = [v.tolist() for v in out.fields["token_versions"]]
        assert out.version == 0  # the oldest token's
        if partial:
            assert all(v[0] == 0 and v[-1] == 1 for v in versions)
            assert out.metrics["interrupted_episodes"] == 2
        else:
            assert all(set(v) == {0} for v in versions)
            assert out.metrics["interrupted_episodes"] == 0
        assert role.batcher.engine.version == 1


async def test_simulated_episode_workers_of_one_process_decode_at_once() -> None:
    # More workers than the default executor's threads on a small machine (cpus + 4): each
    # one's modelled prefill (a 1 s sleep in its thread) must not wait for another's.
    workers = 16
    cost = SimCost(prompt_len=1, max_new_tokens=1, log_mean=0.0, log_sigma=0.0,
                   episode_turns=1, rollout_base_s=1.0, rollout_token_s=0.0)
    roles = [sim_episode_role(cost, seed=i) for i in range(workers)]
    t0 = time.perf_counter()
    await asyncio.gather(*(r.run(*_task(1)) for r in roles))
    assert time.perf_counter() - t0 < 1.8


def test_sim_episode_fields_are_validated_and_compiled() -> None:
    with pytest.raises(ValidationError, match=r"tool_s: models episodes: set episode_turns"):
        SimConfig(tool_s=0.1)
    with pytest.raises(ValidationError, match="episode_turns"):
        SimConfig(episode_turns=-1)
    with pytest.raises(ValidationError, match=r"rollout\.partial: .*sim\.episode_turns > 0"):
        Recipe(steps=1, rollout=RolloutConfig(engine="sim", partial=True))
    r = agent.sim_recipe(2, partial=True)
    assert r.sim_episodes
    assert "reward" not in r.roles
    spec = r.to_pipeline()
    assert [s.name for s in spec.stages] == ["rollout", "train"]
    assert "token_versions" in spec.stages[0].produces
    cost = SimCost.from_dict(spec.engine_config)
    assert cost.partial
    assert cost.episode_turns == 4
    assert isinstance(sim_rollout(SimCost(), 0), type(sim_rollout(SimCost(), 1)))
    assert not isinstance(sim_rollout(SimCost(), 0), EpisodeRolloutRole)  # single turn


def test_agent_bench_figures_of_a_run() -> None:
    summary = {"wall_s": 2.0, "samples": 32, "samples_per_s": 16.0, "stale_dropped": 0}
    log = [{"reward_mean": 0.5, "rollout_turns": 40.0, "rollout_tool_calls": 8.0,
            "rollout_decode_forwards": 10.0, "rollout_decode_rows": 40.0,
            "rollout_interrupted_episodes": 3.0},
           {"reward_mean": 0.7, "rollout_turns": 20.0, "rollout_tool_calls": 4.0,
            "rollout_decode_forwards": 10.0, "rollout_decode_rows": 20.0}]
    got = agent.run_figures(summary, log, capacity=8)
    assert got == {"samples_per_s": 16.0, "wall_s": 2.0, "stale_dropped": 0,
                   "episodes_per_s": 16.0, "turns_per_s": 30.0, "tool_calls_per_s": 6.0,
                   "engine_batch_occupancy": 0.375, "interrupted_episodes": 3,
                   "reward_final": 0.6}
    assert agent.speedup([{"samples_per_s": 18.0}, {"samples_per_s": 12.0}],
                         [{"samples_per_s": 10.0}]) == 1.5


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_simulated_agentic_run_with_partial_rollout_gives_the_bench_figures() -> None:
    got = await agent.measure(agent.sim_recipe(2, partial=True))
    assert got["samples_per_s"] > 0
    assert got["episodes_per_s"] > 0
    assert got["turns_per_s"] >= got["episodes_per_s"]
    assert got["tool_calls_per_s"] > 0
    assert 0.0 < got["engine_batch_occupancy"] <= 1.0
    assert got["stale_dropped"] == 0


def test_rollout_tasks_per_worker_is_validated_and_compiled() -> None:
    def capacity(r: Recipe) -> int:
        return next(p.capacity for p in r.to_pipeline().pools if p.role == "rollout")

    for bad in (0, 4097, "all"):
        with pytest.raises(ValidationError, match="tasks_per_worker"):
            RolloutConfig(tasks_per_worker=bad)
    # A single-completion rollout worker runs one task at a time: more is refused, by name.
    with pytest.raises(ValidationError, match=r"rollout\.tasks_per_worker: a single-completion"):
        Recipe(steps=1, rollout=RolloutConfig(engine="sim", tasks_per_worker=2))
    assert capacity(Recipe(steps=1, rollout=RolloutConfig(engine="sim",
                                                          tasks_per_worker="auto"))) == 1
    assert capacity(agent.sim_recipe(2, partial=False, tasks=3)) == 3
    # auto: every group the staleness bound lets run at once, (1 + 1) x 8 over the workers...
    one = agent.sim_recipe(2, partial=True)
    assert one.rollout.workers == 1
    assert one.rollout_tasks_per_worker == capacity(one) == 16
    auto = agent.sim_recipe(2, partial=True, workers=4)
    assert auto.rollout.tasks_per_worker == "auto"
    assert auto.rollout_tasks_per_worker == capacity(auto) == 4
    # ... but no more than the running batch holds (16 sequences: two tasks of 8).
    small = auto.model_copy(update={"sim": auto.sim.model_copy(update={"max_running": 16})})
    assert small.rollout_tasks_per_worker == 2
    assert capacity(agent.sim_recipe(2, partial=True, tasks=1)) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_worker_of_several_tasks_batches_them_and_drains_before_a_load() -> None:
    from flowrl import AlgorithmConfig, TrainerConfig
    from flowrl.controller import Controller

    steps, group = 3, 4
    r = Recipe(
        steps=steps, max_staleness=1, algorithm=AlgorithmConfig(group_size=group),
        rollout=RolloutConfig(engine="sim", workers=1, max_new_tokens=64, tasks_per_worker=4),
        trainer=TrainerConfig(groups_per_step=4, micro_batch_groups=2),
        sim=SimConfig(prompt_len=4, episode_turns=2, log_mean=math.log(16), log_sigma=1.0,
                      tool_s=0.005, tool_tokens=2, rollout_token_s=0.001, weight_load_s=0.01))
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=100)
    assert out["version"] == steps
    log = ctl.step_log
    rows = sum(e.get("rollout_decode_rows", 0.0) for e in log)
    forwards = sum(e.get("rollout_decode_forwards", 0.0) for e in log)
    # One running batch for several tasks' episodes: more rows per decode than a task has.
    assert rows / forwards > group
    # partial off: the worker loaded every version with no task running (it admitted none
    # while the version waited), so no episode spans two versions.
    assert not [e for e in ctl.events.recent if e["kind"] == "interrupted"]
    assert sum(e.get("rollout_interrupted_episodes", 0.0) for e in log) == 0
