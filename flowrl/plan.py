"""``python -m flowrl.plan TRACE [--set K=V1,V2 ...] [--steps N] [--json]``: predict a run.

Replays a recorded run's trace (``python -m flowrl.launch ... --record-trace TRACE``, or the
monitor's ``GET /plan-trace``) through the real controller with simulated workers
(``rollout.engine="sim"``) whose task times, response lengths and weight loads are drawn from
the trace (`flowrl.trace_costs`), once per combination of the ``--set`` values: any recipe field
(``max_staleness=0,1,2``, ``rollout.workers=1,2``, ``trainer.micro_batch_groups=4,8``,
``rollout.groups_per_task=1,2``), and ``nodes=N``, the number of nodes like the recorded one to
spread the workers over. Prints one line per plan (predicted samples/s, the staleness of the
trained samples, the idle share of each pool) and a recommendation.

CPU contention. A plan that keeps more worker threads busy than the cores it has slows every
task. Its demand is the busy worker threads it keeps on average (each pool's busy share times
its workers times their threads), plus the controller's process: its CPU per trained sample
(the trace header's ``controller``) times the samples per second; the recorded run's is
measured on its trace, a plan's on a first replay at the recorded speed. When a plan's demand
exceeds its cores (the recorded run's ``cpus`` times ``nodes``) by more than the recorded run's
did, it is replayed again with every time stretched by the ratio of the two overloads (``cpu
x``; under 1.05 it is taken as 1).
The prediction is for the machine the trace was recorded on, under the load it had then.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.controller import Controller
    from flowrl.recipe import Recipe
    from flowrl.run_trace import RunTrace

EXIT_INPUT = 2

#: the planner's own knob (not a recipe field): nodes like the recorded one
NODES = "nodes"
#: a plan within this share of the fastest one counts as as fast (the recommendation then
#: prefers fresher samples)
SAME_SPEED = 0.05
#: a CPU stretch below this is noise in the busy shares, not worth a second replay
MIN_STRETCH = 1.05


@dataclass
class Plan:
    """One combination of knob values and what its replay measured."""

    knobs: dict[str, Any]
    stretch: float = 1.0
    samples_per_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {"knobs": self.knobs, "samples_per_s": round(self.samples_per_s, 3),
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "idle": {r: round(v, 3) for r, v in self.idle.items()},
                "cpu_stretch": round(self.stretch, 3)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m flowrl.plan",
        description="Predict throughput, staleness and idle time of a run under changed "
                    "settings, by replaying a recorded trace through the controller.")
    p.add_argument("trace", help="a trace file (python -m flowrl.launch ... --record-trace "
                                 "FILE, or the monitor's /plan-trace)")
    p.add_argument("--set", dest="knobs", action="append", default=[], metavar="KEY=V1,V2",
                   help="a recipe field and the values to try, e.g. --set max_staleness=0,1,2 "
                        "(repeatable: every combination is replayed); nodes=N spreads the "
                        "workers over N nodes like the recorded one")
    p.add_argument("--steps", type=int, help="optimizer steps per replay (default: as many "
                                             "as the trace holds)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON lines too")
    return p.parse_args(argv)


def knob_values(text: str) -> tuple[tuple[str, ...], list[Any]]:
    """``"a.b=1,2"`` → (("a", "b"), [1, 2]); a JSON list or map value is one value."""
    from flowrl.recipe_file import parse_override

    keys, value = parse_override(text, file="--set")
    raw = text.partition("=")[2].strip()
    if raw[:1] in "[{" or "," not in raw:
        return keys, [value]
    return keys, [parse_override(f"{'.'.join(keys)}={part}", file="--set")[1]
                  for part in raw.split(",")]


def plans_of(knobs: Sequence[tuple[tuple[str, ...], list[Any]]]) -> list[dict[str, Any]]:
    """Every combination of the knobs' values, as ``{"a.b": value, ...}``."""
    names = [".".join(k) for k, _ in knobs]
    return [dict(zip(names, combo, strict=True))
            for combo in itertools.product(*(values for _, values in knobs))]


def busy_shares(trace: RunTrace) -> dict[str, float]:
    """Each role's mean busy share per worker over the recorded run."""
    if not trace.tasks:
        return {}
    start = min(t.t - t.s for t in trace.tasks)
    wall = max(t.t for t in trace.tasks) - start
    pools = trace.header["pools"]
    out: dict[str, float] = {}
    for role, count in pools.items():
        busy = sum(t.s for t in trace.tasks_of(role))
        out[role] = min(1.0, busy / (wall * count)) if wall > 0 else 0.0
    return out


def role_threads(recipe: Recipe) -> dict[str, int]:
    """Threads each worker of a role computes with."""
    return {"rollout": recipe.rollout.threads, "reward": recipe.reward.threads,
            "reference": recipe.rollout.threads, "critic": recipe.critic.threads,
            "train": recipe.trainer.threads}


def demand(recipe: Recipe, busy: dict[str, float]) -> float:
    """Busy worker threads on average: ``busy`` is each role's busy share per worker."""
    threads = role_threads(recipe)
    pools = {p.role: p.count for p in recipe.to_pipeline().pools}
    return sum(n * threads.get(r, 1) * busy.get(r, 0.0) for r, n in pools.items())


def controller_cpu_per_sample(trace: RunTrace) -> float:
    """The controller process's CPU seconds per trained sample in the recorded run (0.0 for a
    trace that does not say)."""
    ctl = trace.header.get("controller")
    if not isinstance(ctl, dict) or not ctl.get("samples"):
        return 0.0
    return float(ctl["cpu_s"]) / int(ctl["samples"])


def samples_per_s(trace: RunTrace) -> float:
    """The recorded run's trained samples per second, over the span its tasks cover."""
    if not trace.tasks or not trace.steps:
        return 0.0
    start = min(t.t - t.s for t in trace.tasks)
    wall = trace.steps[-1].t - start
    return sum(s.samples for s in trace.steps) / wall if wall > 0 else 0.0


def cpu_stretch(recorded_demand: float, recorded_cores: int, planned_demand: float,
                planned_cores: int) -> float:
    """How much slower each task runs in the plan than in the recorded run: the ratio of the
    two overloads (1 when the plan's cores keep up with its demand as well as the recorded
    run's did)."""
    before = max(1.0, recorded_demand / recorded_cores)
    after = max(1.0, planned_demand / planned_cores)
    return max(1.0, after / before)


def sim_recipe(recorded: Recipe, knobs: dict[str, Any], trace_path: Path,
               stretch: float) -> Recipe:
    """The recorded recipe with ``knobs`` applied, run by simulated workers drawing from the
    trace: nothing written, no evaluation, no trackers."""
    from flowrl.recipe_file import apply_overrides

    overrides: list[tuple[tuple[str, ...], Any]] = [
        (tuple(k.split(".")), v) for k, v in knobs.items() if k != NODES]
    overrides += [(("rollout", "engine"), "sim"), (("sim", "trace"), str(trace_path)),
                  (("sim", "trace_stretch"), stretch), (("output",), None),
                  (("checkpoint_every",), 0), (("keep_last",), None), (("eval",), None),
                  (("tracking",), [])]
    return apply_overrides(recorded, overrides, file="--set")


async def replay(recipe: Recipe, steps: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Run ``recipe`` (simulated) for ``steps`` steps: its summary and each pool's idle
    share."""
    from flowrl.run import run_recipe

    held: list[Controller] = []
    summary = await run_recipe(recipe, steps=steps, monitor=False, on_start=held.append)
    return summary, idle_shares(held[0], summary["wall_s"])


def idle_shares(ctl: Controller, wall: float) -> dict[str, float]:
    """Each pool's share of worker time spent without a task over the last ``wall`` s."""
    import time

    end = time.time()
    start = end - wall
    busy: dict[str, float] = {}
    for s in ctl.events.spans:
        overlap = min(s.end, end) - max(s.start, start)
        if overlap > 0:
            busy[s.role] = busy.get(s.role, 0.0) + overlap
    return {p.role: max(0.0, 1.0 - busy.get(p.role, 0.0) / (wall * p.count))
            for p in ctl.spec.pools if wall > 0}


def recommend(plans: Sequence[Plan]) -> str:
    """The fastest plan, or a plan as fast with fresher samples; and its bottleneck pool."""
    if not plans:
        return "nothing to recommend"
    best = max(p.samples_per_s for p in plans)
    fast = [p for p in plans if p.samples_per_s >= best * (1 - SAME_SPEED)]
    pick = min(fast, key=lambda p: (_mean_staleness(p), -p.samples_per_s))
    said = ", ".join(f"{k}={v}" for k, v in pick.knobs.items()) or "the recorded settings"
    text = f"recommended: {said} ({pick.samples_per_s:.1f} samples/s predicted"
    if len(fast) > 1 and pick.samples_per_s < best:
        text += f", within {SAME_SPEED:.0%} of the fastest with fresher samples"
    text += ")"
    if pick.idle:
        role, idle = min(pick.idle.items(), key=lambda kv: kv[1])
        text += f"; its bottleneck is the {role} pool (idle {idle:.0%})"
    return text


def _mean_staleness(p: Plan) -> float:
    n = sum(p.staleness.values())
    return sum(k * v for k, v in p.staleness.items()) / n if n else 0.0


def table(plans: Sequence[Plan]) -> str:
    """The plans, one line each."""
    names = list(dict.fromkeys(k for p in plans for k in p.knobs))
    roles = list(dict.fromkeys(r for p in plans for r in p.idle))
    head = [*names, "samples/s", "staleness (share by versions behind)",
            *(f"idle {r}" for r in roles), "cpu x"]
    rows = [head]
    for p in plans:
        total = sum(p.staleness.values()) or 1
        stale = " ".join(f"{k}:{v / total:.0%}" for k, v in p.staleness.items()) or "-"
        rows.append([*(str(p.knobs.get(n, "-")) for n in names), f"{p.samples_per_s:.1f}",
                     stale, *(f"{p.idle[r]:.0%}" if r in p.idle else "-" for r in roles),
                     f"{p.stretch:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


async def plan(trace_path: Path, knobs: Sequence[tuple[tuple[str, ...], list[Any]]], *,
               steps: int | None = None) -> list[Plan]:
    """Replay the trace once per combination of ``knobs``; raises `TraceError` for a trace
    that cannot be replayed and `RecipeError` for a knob the recipe refuses."""
    from flowrl.recipe import Recipe
    from flowrl.run_trace import TraceError, read_trace

    trace = read_trace(trace_path)
    if trace.recipe is None:
        raise TraceError(f"{trace_path}: the trace holds no recipe (it was not recorded from a "
                         "run started from a recipe), so there is nothing to replay")
    if not trace.tasks:
        raise TraceError(f"{trace_path}: the trace holds no finished task to draw times from")
    recorded = Recipe.model_validate(trace.recipe)
    steps = steps or max(1, len(trace.steps))
    out: list[Plan] = []
    cores = int(trace.header["cpus"])
    per_sample = controller_cpu_per_sample(trace)
    recorded_demand = demand(recorded, busy_shares(trace)) + per_sample * samples_per_s(trace)
    for combo in plans_of(knobs) or [{}]:
        nodes = int(combo.get(NODES, 1))
        if nodes < 1:
            raise ValueError(f"--set {NODES}: must be at least 1, got {nodes}")
        planned = sim_recipe(recorded, combo, trace_path, 1.0)
        summary, idle = await replay(planned, steps)
        planned_demand = (demand(planned, {r: 1 - v for r, v in idle.items()})
                          + per_sample * float(summary["samples_per_s"]))
        stretch = cpu_stretch(recorded_demand, cores, planned_demand, cores * nodes)
        if stretch < MIN_STRETCH:
            stretch = 1.0
        else:
            summary, idle = await replay(sim_recipe(recorded, combo, trace_path, stretch),
                                         steps)
        out.append(Plan(combo, stretch, float(summary["samples_per_s"]),
                        {int(k): int(v) for k, v in summary["staleness"].items()}, idle))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from flowrl.logs import configure
    from flowrl.recipe_file import RecipeError
    from flowrl.run_trace import TraceError

    try:
        knobs = [knob_values(k) for k in args.knobs]
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    configure()
    try:
        plans = asyncio.run(plan(Path(args.trace), knobs, steps=args.steps))
    except (TraceError, RecipeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    print(table(plans))
    if args.json:
        for p in plans:
            print(json.dumps(p.row()))
    print(recommend(plans))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
