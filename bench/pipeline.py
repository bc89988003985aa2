"""Pipeline benchmark: what streaming and bounded staleness buy, and what the controller costs.

Runs the same simulated GRPO workload (real controller, real worker processes, real ZeroMQ and
shared memory; modelled compute) at max_staleness 0, 1 and 2 for the same number of trained
samples, then a short run with 256 simulated workers for dispatch latency. Prints one JSON line.

Workload (stated, as `SimCost` in workers/sim.py): groups of 4 responses whose lengths are
lognormal (median 96 tokens, sigma 1.0, capped at 1024); a group decodes as one batch, so its
time is set by its longest response (the long tail); 8 groups per optimizer step spread over
8 rollout workers; training costs about as much as one median group per step.

    python bench/pipeline.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.index import bench_index
from bench.runner import run_and_print
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages

COST = {
    "prompt_len": 64, "max_new_tokens": 1024, "log_mean": math.log(96), "log_sigma": 1.0,
    "rollout_base_s": 0.005, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00001, "train_step_s": 0.01,
    "weight_numel": 1 << 16,
}


def workload(staleness: int, *, rollout: int = 8, reward: int = 1,
             per_process: int = 8) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2, reward_micro_batch=8),
        pools=(PoolSpec("rollout", count=rollout, per_process=per_process),
               PoolSpec("reward", count=reward, per_process=min(reward, per_process)),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=8, max_staleness=staleness, engine="sim",
        engine_config=COST, store_capacity_bytes=256 << 20, heartbeat_s=1.0,
        heartbeat_timeout_s=30.0,
    )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(spec: PipelineSpec, steps: int) -> dict[str, Any]:
    async with Controller(spec) as ctl:
        await ctl.run(steps=1, timeout_s=120)  # warm-up: processes, mappings, first version
        ctl.dispatch_us.clear()
        cpu0 = time.process_time()
        out = await ctl.run(steps=steps, timeout_s=600)
        cpu = time.process_time() - cpu0
        out["dispatch_us"] = list(ctl.dispatch_us)
        out["controller_cpu_share"] = cpu / out["wall_s"]
        return out


async def main_async(quick: bool) -> dict[str, Any]:
    steps = 6 if quick else 20
    runs = {s: await measure(workload(s), steps) for s in (0, 1, 2)}
    rate = {s: r["samples_per_s"] for s, r in runs.items()}
    big = await measure(workload(1, rollout=224, reward=31, per_process=32), 2 if quick else 4)
    d8 = runs[1]["dispatch_us"]
    return {
        "samples_per_s_s0": round(rate[0], 1),
        "samples_per_s_s1": round(rate[1], 1),
        "samples_per_s_s2": round(rate[2], 1),
        "speedup_s1": round(rate[1] / rate[0], 2),
        "speedup_s2": round(rate[2] / rate[0], 2),
        "stale_dropped_s1": runs[1]["stale_dropped"],
        "stale_dropped_s2": runs[2]["stale_dropped"],
        "index_rows_per_s": round(bench_index(20_000 if quick else 200_000)),
        "dispatch_p50_us": round(statistics.median(d8), 1) if d8 else None,
        "dispatch_p99_us": round(pct(d8, 0.99), 1),
        "dispatch_p99_us_256w": round(pct(big["dispatch_us"], 0.99), 1),
        "workers": 10,
        "workers_big": 256,
        "controller_cpu_share": round(runs[1]["controller_cpu_share"], 3),
        "steps": steps,
        "quick": quick,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps (< 60 s), same keys")
    args = p.parse_args()
    configure(level="warning")
    run_and_print(main_async(args.quick))


if __name__ == "__main__":
    main()
