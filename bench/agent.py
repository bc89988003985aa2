"""Agentic-rollouts benchmark: multi-turn episodes with tools, and what ``rollout.partial`` buys.

Two workloads, each run with ``rollout.partial`` off and on at the same ``max_staleness``,
``--repeats`` times each way (off-on, on-off, ...: 2, ``--quick`` 1), one run at a time,
through a real `Controller` (real processes, sockets, shared memory, weight sync):

- **sim**: simulation mode's episodes (``sim.episode_turns``, `workers.sim_episode`: the real
  episode rollout role and continuous batcher on a decode loop of modelled cost), long-tailed:
  1-4 turns per episode, per-turn lengths lognormal (median 32 tokens, sigma 1.2, capped at 512),
  a 20 ms tool call inserting 16 tokens between turns, a 10 ms weight load; one rollout worker
  (one engine, as an inference server) running ``rollout.tasks_per_worker = "auto"`` tasks at
  once: all 16 groups the staleness bound lets be in flight, 128 episodes in one batch;
- **real**: the tool recipe (``recipes/tool_cpu.py``) on the real tiny model and its tool
  sandboxes, a handful of steps (``--quick``) or more.

Prints one JSON line. Keys (the real model's runs with ``partial`` off, means over the runs,
unless named otherwise):

- ``episodes_per_s`` (trained episodes), ``turns_per_s``, ``tool_calls_per_s`` (of the rollout
  tasks reported during the run), over the run's wall time;
- ``engine_batch_occupancy``: decoded sequences per decode forward (the step log's
  ``rollout_decode_rows / rollout_decode_forwards``) over the episodes a rollout worker runs at
  once (group size × groups per task × ``rollout.tasks_per_worker``);
- ``partial_speedup``: the sim workload's mean samples/s with ``partial`` on ÷ off;
  ``partial_speedup_real``: the same on the real model;
- ``reward_final_partial`` / ``reward_final_full``: the real model's mean reward over its last
  10 steps (`bench.learning.first_and_final`) with ``partial`` on / off;
- ``sim.4_workers.partial_speedup`` (full run only): ``partial_speedup`` with the groups
  spread over four rollout workers (``"auto"``: 4 tasks, 32 episodes, each), so a worker that
  waits for its running episodes before a load holds back a quarter of the batch;
- ``sim.1_task.partial_speedup`` (full run only): the same four workers each running one task
  at a time (``rollout.tasks_per_worker = 1``), so a batch drains to a group's tail at every
  task's end;
- ``sim`` and ``real``: each run's figures, listed under ``off`` and ``on``
  (``samples_per_s``, ``wall_s``, ``stale_dropped``, ``interrupted_episodes``, the rates
  above, ``reward_final``), and the workload's ``partial_speedup``; ``load_before`` /
  ``load_after``: the machine's 1-minute load average; ``repeats``, ``quick``, ``cpus``.

    python bench/agent.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learning import first_and_final, load_average, run_logged
from bench.runner import run_and_print
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
TOOL_RECIPE = ROOT / "recipes" / "tool_cpu.py"

#: the long-tailed simulated workload (see the module docstring)
SIM: dict[str, Any] = {
    "prompt_len": 32, "episode_turns": 4, "log_mean": math.log(32), "log_sigma": 1.2,
    "tool_s": 0.02, "tool_tokens": 16, "rollout_base_s": 0.002, "rollout_token_s": 0.0005,
    "weight_load_s": 0.01, "train_token_s": 0.000005, "train_step_s": 0.01,
    "reference_token_s": 0.0, "reward_token_s": 0.0}


def sim_recipe(steps: int, partial: bool, tasks: int | str = "auto",
               workers: int = 1) -> Recipe:
    """The simulated episode workload: groups of 8, 8 groups per step, staleness 1, on
    ``workers`` rollout workers (one process); ``tasks``: ``rollout.tasks_per_worker`` ("auto":
    every group the staleness bound lets run at once, (1 + 1) x 8 over ``workers``)."""
    from flowrl import AlgorithmConfig, RolloutConfig, SimConfig, TrainerConfig

    return Recipe(
        steps=steps, max_staleness=1, algorithm=AlgorithmConfig(group_size=8),
        rollout=RolloutConfig(engine="sim", workers=workers, max_new_tokens=512, partial=partial,
                              tasks_per_worker=tasks),
        trainer=TrainerConfig(groups_per_step=8, micro_batch_groups=2),
        sim=SimConfig(**SIM))


def run_figures(summary: dict[str, Any], log: list[dict[str, Any]], capacity: int
                ) -> dict[str, Any]:
    """A run's rates from its summary and step log; ``capacity``: the episodes one rollout
    worker runs at once."""
    wall = float(summary["wall_s"])

    def total(key: str) -> float:
        return sum(float(e.get(key, 0.0)) for e in log)

    forwards = total("rollout_decode_forwards")
    rewards = [float(e["reward_mean"]) for e in log if e.get("reward_mean") is not None]
    return {
        "samples_per_s": round(float(summary["samples_per_s"]), 2),
        "wall_s": round(wall, 2),
        "stale_dropped": int(summary["stale_dropped"]),
        "episodes_per_s": round(float(summary["samples"]) / wall, 2),
        "turns_per_s": round(total("rollout_turns") / wall, 2),
        "tool_calls_per_s": round(total("rollout_tool_calls") / wall, 2),
        "engine_batch_occupancy": (round(total("rollout_decode_rows") / forwards / capacity, 3)
                                   if forwards else 0.0),
        "interrupted_episodes": int(total("rollout_interrupted_episodes")),
        "reward_final": first_and_final(rewards)[1] if rewards else None,
    }


async def measure(recipe: Recipe) -> dict[str, Any]:
    before = load_average()
    summary, log = await run_logged(recipe)
    capacity = (recipe.algorithm.group_size * recipe.rollout.groups_per_task
                * recipe.rollout_tasks_per_worker)
    return {**run_figures(summary, log, capacity), "load_before": before,
            "load_after": load_average()}


def speedup(on: list[dict[str, Any]], off: list[dict[str, Any]]) -> float:
    """Mean samples/s of the ``on`` runs over the ``off`` runs'."""
    off_rate = mean_of(off, "samples_per_s")
    return round(mean_of(on, "samples_per_s") / off_rate, 3) if off_rate else 0.0


def mean_of(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.fmean(float(r[key]) for r in runs), 4)


async def pairs(make: Callable[[bool], Recipe], repeats: int) -> dict[str, Any]:
    """``repeats`` runs of ``make(partial)`` each way, ordered off-on, on-off, ... (a load that
    drifts across the runs weighs on both sides alike); their figures and ``partial_speedup``."""
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(repeats):
        for partial in ((False, True) if r % 2 == 0 else (True, False)):
            runs["on" if partial else "off"].append(await measure(make(partial)))
    return {**runs, "partial_speedup": speedup(runs["on"], runs["off"])}


async def main_async(quick: bool, repeats: int) -> dict[str, Any]:
    from flowrl.run import prepare_model

    sim_steps, real_steps = (3, 2) if quick else (20, 40)
    sim = await pairs(lambda partial: sim_recipe(sim_steps, partial), repeats)
    if not quick:  # the batch split over four workers; and each of them running one task
        sim["4_workers"] = await pairs(
            lambda partial: sim_recipe(sim_steps, partial, workers=4), repeats)
        sim["1_task"] = await pairs(
            lambda partial: sim_recipe(sim_steps, partial, 1, workers=4), repeats)
    tool = load_recipe(TOOL_RECIPE, [f"steps={real_steps}"])
    await asyncio.to_thread(prepare_model, tool)  # built once (cached after), not timed
    real = await pairs(lambda partial: apply_overrides(
        tool, [(("rollout", "partial"), partial)], file=str(TOOL_RECIPE)), repeats)
    off = real["off"]
    return {
        **{k: mean_of(off, k) for k in ("episodes_per_s", "turns_per_s", "tool_calls_per_s",
                                        "engine_batch_occupancy")},
        "partial_speedup": sim["partial_speedup"],
        "partial_speedup_real": real["partial_speedup"],
        "reward_final_partial": mean_of(real["on"], "reward_final"),
        "reward_final_full": mean_of(off, "reward_final"),
        "sim": sim, "real": real, "sim_steps": sim_steps, "real_steps": real_steps,
        "repeats": repeats, "quick": quick, "cpus": os.cpu_count(),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps per run, one pair")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs each way per workload (default: 2, --quick: 1)")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure(level="warning")
    run_and_print(main_async(args.quick, args.repeats))


if __name__ == "__main__":
    main()
