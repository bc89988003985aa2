"""``python -m flowrl.plan TRACE [--set K=V1,V2 ...] [--steps N] [--json]``: predict a run.

Replays a recorded run's trace (``python -m flowrl.launch ... --record-trace TRACE``, or the
monitor's ``GET /plan-trace``) through the real controller with simulated workers
(``rollout.engine="sim"``) whose task times, response lengths and weight loads are drawn from
the trace (`flowrl.trace_costs`), once per combination of the ``--set`` values: any recipe field
(``max_staleness=0,1,2``, ``rollout.workers=1,2``, ``trainer.micro_batch_groups=4,8``,
``rollout.groups_per_task=1,2``), and ``nodes=N``, the number of nodes like the recorded one to
spread the workers over. Prints one line per plan (predicted samples/s, the staleness of the
trained samples, the idle share of each pool) and a recommendation.

CPU contention (`flowrl.contention`). When more threads are busy than there are cores, each
runs slower; what a role's tasks suffer is ``max(1, busy threads / cores)`` averaged over the
time they run, which depends on when the pools are busy together, not only on how busy each is.
It is computed on a replay of the recorded settings at the recorded speed (what the recorded
times already hold) and on a replay of the plan, from their tasks' busy intervals, each worker's
threads and the controller's process as a constant load (its CPU per trained sample, the trace
header's ``controller``, times the samples per second); the plan is replayed again with each
role's times stretched by the ratio of the two, until the stretches settle (``cpu x``; at most
`MAX_REPLAYS` replays of a plan). Both are measured on replays so that what a replay's schedule
differs from the real run's by cancels out. Cores are the recorded run's ``cpus`` times
``nodes``. A trace recorded from simulated workers (whose tasks are waits, not computation) is
replayed without it. The prediction is for the machine the trace was recorded on, under the
load it had then.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowrl.contention import Busy, slowdowns, stretches
from flowrl.lifecycle import run_loop

if TYPE_CHECKING:
    from flowrl.controller import Controller
    from flowrl.events import Span
    from flowrl.recipe import Recipe
    from flowrl.run_trace import RunTrace

EXIT_INPUT = 2

#: the planner's own knob (not a recipe field): nodes like the recorded one
NODES = "nodes"
#: a plan within this share of the fastest one counts as as fast (the recommendation then
#: prefers fresher samples)
SAME_SPEED = 0.05
#: stretches that move less than this share between two replays have settled
SETTLED = 0.05
#: replays of one plan at most (the first at the recorded speed)
MAX_REPLAYS = 3


@dataclass
class Plan:
    """One combination of knob values and what its replay measured."""

    knobs: dict[str, Any]
    #: each role's CPU stretch (a role not named: 1.0)
    stretch: dict[str, float] = field(default_factory=dict)
    samples_per_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {"knobs": self.knobs, "samples_per_s": round(self.samples_per_s, 3),
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "idle": {r: round(v, 3) for r, v in self.idle.items()},
                "cpu_stretch": {r: round(v, 3) for r, v in self.stretch.items()}}

    def stretch_text(self) -> str:
        said = [f"{r} {v:.2f}" for r, v in self.stretch.items() if round(v, 2) != 1.0]
        return ", ".join(said) or "1.00"


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


def role_threads(recipe: Recipe) -> dict[str, int]:
    """Threads each worker of a role computes with."""
    return {"rollout": recipe.rollout.threads, "reward": recipe.reward.threads,
            "reference": recipe.rollout.threads, "critic": recipe.critic.threads,
            "train": recipe.trainer.threads}


def controller_cpu_per_sample(trace: RunTrace) -> float:
    """The controller process's CPU seconds per trained sample in the recorded run (0.0 for a
    trace that does not say)."""
    ctl = trace.header.get("controller")
    if not isinstance(ctl, dict) or not ctl.get("samples"):
        return 0.0
    return float(ctl["cpu_s"]) / int(ctl["samples"])


def replayed_busy(spans: Sequence[Span], recipe: Recipe) -> list[Busy]:
    """A replay's task spans as busy intervals: a worker's task that it took while it ran the
    one before (prefetch) counts from when that one ended."""
    threads = role_threads(recipe)
    out: list[Busy] = []
    free: dict[str, float] = {}
    for s in sorted(spans, key=lambda s: s.start):
        start = max(s.start, free.get(s.worker, s.start))
        free[s.worker] = max(s.end, free.get(s.worker, s.end))
        out.append(Busy(s.role, start, s.end, threads.get(s.role, 1)))
    return out


def sim_recipe(recorded: Recipe, knobs: dict[str, Any], trace_path: Path,
               stretch: dict[str, float]) -> Recipe:
    """The recorded recipe with ``knobs`` applied, run by simulated workers drawing from the
    trace: nothing written, no evaluation, no trackers."""
    from flowrl.recipe_file import apply_overrides

    overrides: list[tuple[tuple[str, ...], Any]] = [
        (tuple(k.split(".")), v) for k, v in knobs.items() if k != NODES]
    overrides += [(("rollout", "engine"), "sim"), (("sim", "trace"), str(trace_path)),
                  (("sim", "trace_stretch"), dict(stretch) or 1.0), (("output",), None),
                  (("checkpoint_every",), 0), (("keep_last",), None), (("eval",), None),
                  (("tracking",), [])]
    return apply_overrides(recorded, overrides, file="--set")


@dataclass
class Replay:
    #: the simulated recipe it ran
    recipe: Recipe
    summary: dict[str, Any]
    #: each pool's share of worker time spent without a task
    idle: dict[str, float]
    #: the tasks' spans in the measured run
    spans: list[Span]


async def replay(recipe: Recipe, steps: int) -> Replay:
    """Run ``recipe`` (simulated) for ``steps`` steps."""
    import time

    from flowrl.run import run_recipe

    held: list[Controller] = []
    commits: list[float] = []

    def started(ctl: Controller) -> None:
        held.append(ctl)
        ctl.on_step.append(lambda _: commits.append(time.time()))

    summary = await run_recipe(recipe, steps=steps, monitor=False, on_start=started)
    # The measured run ends at its last commit, not when run_recipe returns: closing the
    # workers takes a while on busy cores, and a window ending then misses the first tasks.
    end = commits[-1] if commits else time.time()
    start = end - summary["wall_s"]
    spans = [s for s in held[0].events.spans if s.end > start]
    return Replay(recipe, summary, idle_shares(held[0], spans, start, end), spans)


def crowding(run: Replay, cores: int, per_sample: float) -> dict[str, float]:
    """Each role's slowdown (`flowrl.contention`) in ``run``: its tasks' busy intervals, and
    the controller's ``per_sample`` CPU at the replay's rate as a constant load."""
    return slowdowns(replayed_busy(run.spans, run.recipe), cores,
                     per_sample * float(run.summary["samples_per_s"]))


def idle_shares(ctl: Controller, spans: Sequence[Span], start: float,
                end: float) -> dict[str, float]:
    """Each pool's share of worker time spent without a task from ``start`` to ``end``."""
    wall = end - start
    busy: dict[str, float] = {}
    for s in spans:
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
                     p.stretch_text()])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


async def plan(trace_path: Path, knobs: Sequence[tuple[tuple[str, ...], list[Any]]], *,
               steps: int | None = None, contention: bool | None = None) -> list[Plan]:
    """Replay the trace once per combination of ``knobs``; raises `TraceError` for a trace
    that cannot be replayed and `RecipeError` for a knob the recipe refuses. ``contention``:
    whether to model CPU contention (default: unless the trace is of simulated workers)."""
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
    # simulated workers wait, they do not compute
    contended = recorded.rollout.engine != "sim" if contention is None else contention
    # What the recorded times already hold, measured on a replay of the recorded settings like
    # a plan's, so that what a replay's schedule differs from the run's by cancels out.
    before = crowding(await replay(sim_recipe(recorded, {}, trace_path, {}), steps), cores,
                      per_sample) if contended else {}
    for combo in plans_of(knobs) or [{}]:
        nodes = int(combo.get(NODES, 1))
        if nodes < 1:
            raise ValueError(f"--set {NODES}: must be at least 1, got {nodes}")
        stretch: dict[str, float] = {}
        run = await replay(sim_recipe(recorded, combo, trace_path, stretch), steps)
        for _ in range(MAX_REPLAYS - 1 if contended else 0):
            after = crowding(run, cores * nodes, per_sample)
            want = {r: round(x, 3) for r, x in stretches(after, before).items()}
            if all(abs(x / stretch.get(r, 1.0) - 1) < SETTLED for r, x in want.items()):
                break
            stretch = want
            run = await replay(sim_recipe(recorded, combo, trace_path, stretch), steps)
        out.append(Plan(combo, stretch, float(run.summary["samples_per_s"]),
                        {int(k): int(v) for k, v in run.summary["staleness"].items()},
                        run.idle))
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
        plans = run_loop(plan(Path(args.trace), knobs, steps=args.steps))
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
