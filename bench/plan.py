"""The planner checked against real runs of the default recipe (recipes/tiny_cpu.py).

Per round: one real run at the recipe's settings (``max_staleness=1``, one rollout worker)
records its trace, then the same recipe at ``max_staleness=0`` and with two rollout workers runs
for real, right after (the cores are shared: runs close in time see similar load); the planner
(`flowrl.plan`) then predicts all three from the round's trace, and each prediction's error is
stated.

    python bench/plan.py [--steps N] [--rounds N] [--quick]

Keys: ``rounds`` (per round, per setting: ``measured`` and ``predicted`` samples/s, ``error`` =
predicted ÷ measured − 1, the prediction's staleness histogram, idle share per pool and CPU
stretch per role, the real run's load average before it and its tasks' mean time,
``task_time_ratio``: that mean over the recorded run's, which says how much the machine's load
moved between the runs), ``median_error`` per setting over the rounds, ``worst_error``. Every
rate is trained samples per second of `Controller.run` wall time. ``--quick``: one round of 30
steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runner import library_versions, run_and_print
from flowrl import plan as planner
from flowrl.logs import configure
from flowrl.recipe_file import apply_overrides, load_recipe
from flowrl.run import run_recipe
from flowrl.run_trace import read_trace

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.py"
#: the settings run and predicted: (max_staleness, rollout.workers); the first is recorded
SETTINGS = [(1, 1), (0, 1), (1, 2)]


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


async def real(staleness: int, workers: int, steps: int, trace: Path) -> dict[str, Any]:
    """One real run; its samples/s, wall time, the load before it and its mean task time."""
    recipe = apply_overrides(load_recipe(str(RECIPE)), [
        (("steps",), steps), (("max_staleness",), staleness),
        (("rollout", "workers"), workers)])
    load = load_average()
    summary = await run_recipe(recipe, monitor=False, record_trace=trace)
    tasks = read_trace(trace).tasks
    return {"samples_per_s": round(float(summary["samples_per_s"]), 1),
            "wall_s": round(float(summary["wall_s"]), 1), "load_before": load,
            "task_s_per_row": sum(t.s for t in tasks) / max(1, sum(t.rows for t in tasks))}


async def one_round(steps: int, tmp: Path) -> list[dict[str, Any]]:
    traces = {s: tmp / f"s{s[0]}_w{s[1]}.trace.jsonl" for s in SETTINGS}
    measured = {s: await real(*s, steps, traces[s]) for s in SETTINGS}
    recorded = traces[SETTINGS[0]]
    plans = [*await planner.plan(recorded, [planner.knob_values("max_staleness=1,0")]),
             *await planner.plan(recorded, [planner.knob_values("rollout.workers=2")])]
    base = measured[SETTINGS[0]]["task_s_per_row"]
    out = []
    for setting, p in zip(SETTINGS, plans, strict=True):
        m = measured[setting]
        out.append({"max_staleness": setting[0], "rollout_workers": setting[1],
                    "recorded": setting == SETTINGS[0],
                    "measured": m["samples_per_s"], "predicted": round(p.samples_per_s, 1),
                    "error": round(p.samples_per_s / m["samples_per_s"] - 1, 3),
                    "wall_s": m["wall_s"], "load_before": m["load_before"],
                    "task_time_ratio": round(m["task_s_per_row"] / base, 2),
                    "predicted_staleness": p.staleness, "predicted_idle": p.row()["idle"],
                    "cpu_stretch": p.row()["cpu_stretch"]})
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    steps, rounds = (30, 1) if args.quick else (args.steps, args.rounds)
    results = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="planner-bench-") as tmp:
            results.append(await one_round(steps, Path(tmp)))
        print(json.dumps({"round": len(results), "runs": results[-1]}), file=sys.stderr,
              flush=True)  # a long series says each round as it ends
    median = {f"s{s[0]}_w{s[1]}": statistics.median(r[i]["error"] for r in results)
              for i, s in enumerate(SETTINGS)}
    return {"steps": steps, "rounds": results, "median_error": median,
            "worst_error": max(abs(x["error"]) for r in results for x in r),
            "cpus": len(os.sched_getaffinity(0)),
            "versions": library_versions(["torch", "transformers"])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    configure(level="warning")
    run_and_print(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
