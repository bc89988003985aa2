"""Learning benchmark of the multi-turn tool recipe (recipes/tool_cpu.py): does the share of
right final answers rise, and does the rise come from calling the tool?

Trains the recipe once per seed, one run at a time, on real processes, the real tiny model and
its real tool sandboxes, and prints one JSON line.

    python bench/tool_learning.py [--seeds 0,1,2] [--steps N] [--set KEY=VALUE ...]
                                  [--log-dir DIR] [--verbose]

Keys:

- ``runs``: one entry per run: ``seed``, ``reward_first`` / ``reward_final`` (mean reward, the
  share of right final answers, over the first / last 10 steps), ``tool_share_first`` /
  ``tool_share_final`` (tool calls per episode over the same steps: the step log's
  ``rollout_tool_calls``, counted over the rollout tasks reported since the step before, over
  the step's episodes), ``reward_step1`` and ``tool_share_step1`` (the warm-started policy's
  first step), ``train_s`` (wall seconds of `Controller.run`; the model build is not timed),
  ``load_before`` / ``load_after`` (the machine's 1-minute load average).
- ``reward_first_mean``, ``reward_final_mean``, ``reward_final_min``, ``tool_share_first_mean``,
  ``tool_share_final_mean``, ``train_s_mean``, ``train_s_max``: over the runs.
- ``build_s``: seconds to build the tiny model (0 when it came from the cache); ``steps``,
  ``seeds``, ``cpus``, ``overrides``, ``versions`` (python, torch, transformers, tokenizers).

A direct answer is a random number (the warm start teaches no sums), so a right answer is, but
for chance, one that called the tool: ``reward`` stays at or under ``tool_share``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learning import first_and_final, load_average, run_logged, versions
from bench.runner import run_and_print, seed_list
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tool_cpu.py"


def curves(log: list[dict[str, Any]]) -> dict[str, float]:
    """First and final rewards and tool calls per episode of a run's step log."""
    steps = [e for e in log if e.get("reward_mean") is not None and e.get("samples")]
    if not steps:
        raise RuntimeError("the run logged no step with a reward")
    rewards = [float(e["reward_mean"]) for e in steps]
    share = [float(e.get("rollout_tool_calls", 0.0)) / float(e["samples"]) for e in steps]
    reward_first, reward_final = first_and_final(rewards)
    share_first, share_final = first_and_final(share)
    return {"reward_step1": round(rewards[0], 4), "tool_share_step1": round(share[0], 4),
            "reward_first": reward_first, "reward_final": reward_final,
            "tool_share_first": share_first, "tool_share_final": share_final}


async def train(recipe: Recipe, step_log: Path | None) -> dict[str, Any]:
    """One run of ``recipe``: its curves and training wall time."""
    summary, log = await run_logged(recipe, step_log)
    return {**curves(log), "train_s": round(float(summary["wall_s"]), 1)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    recipe = load_recipe(RECIPE, overrides)
    from flowrl.run import prepare_model

    t0 = time.perf_counter()
    await asyncio.to_thread(prepare_model, recipe)  # built once, before any run (or cached)
    build_s = round(time.perf_counter() - t0, 1)
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(prefix="flowrl-tool-learning-") as tmp:
            seeded = apply_overrides(recipe, [(("seed",), seed), (("output",), tmp)],
                                     file=str(RECIPE))
            path = None if args.log_dir is None else args.log_dir / f"seed-{seed}.jsonl"
            before = load_average()
            run = await train(seeded, path)
            runs.append({"seed": seed, **run, "load_before": before,
                         "load_after": load_average()})
        if args.verbose:
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)

    def over(key: str, fn: Any = statistics.fmean) -> float:
        return round(float(fn([r[key] for r in runs])), 4)

    return {
        "runs": runs,
        "reward_first_mean": over("reward_first"), "reward_final_mean": over("reward_final"),
        "reward_final_min": over("reward_final", min),
        "tool_share_first_mean": over("tool_share_first"),
        "tool_share_final_mean": over("tool_share_final"),
        "train_s_mean": over("train_s"), "train_s_max": over("train_s", max),
        "build_s": build_s, "steps": recipe.steps, "seeds": list(args.seeds),
        "cpus": os.cpu_count(), "overrides": overrides, "versions": versions(),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=seed_list, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="override the recipe's steps")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="a recipe override, as the launcher's --set")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="write each run's step log there (seed-N.jsonl)")
    p.add_argument("--verbose", action="store_true", help="print each run's entry as it ends")
    args = p.parse_args(argv)
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure(level="warning")
    run_and_print(main_async(args))


if __name__ == "__main__":
    main()
