"""Load: the index at a million rows, the store at capacity, worker churn. Prints one JSON line.

- ``index``: rows of the GRPO graph (`flowrl.pipeline.grpo_stages`) are admitted with their
  prompt positions as the controller admits them, rollout and reward tasks are requested and
  completed with the fields they produce, and every row then waits for training: that is when
  the index holds the most per row. ``index_bytes_per_row`` is the traced memory (tracemalloc)
  per row held then, with opaque handles that cost nothing (the index's own structures);
  ``index_bytes_per_row_wire`` is the same with store handles decoded from msgpack, as the
  controller receives them from workers. Training then retires every row;
  ``index_retained_bytes`` is what is left above the empty index's baseline.
  ``index_rows_per_s`` streams rows through the whole lifecycle (admit, rollout, reward, train,
  retire) without tracing.
- ``registry``: 256 simulated workers register with `flowrl.registry.Registry`, take and finish
  tasks, and leave, round after round; the registry must be empty after each round and the
  traced memory must not grow from round to round.
- ``store``: simulated controller runs (``engine="sim"``: real processes, sockets and shared
  memory). One with a store that holds only a few micro-batches (``--store-kib``, 32 KiB: about
  two steps' samples and weights) must complete, with admission pausing for the store
  (``store_pauses``, ``store_paused_s``) and its use never above capacity; one with a store too
  small for a single step (16 KiB: four groups of one page each plus a page of weights do not
  fit) must stop with an error naming the capacity (``store_small_error``, after
  ``store_small_s`` seconds) instead of stalling.

    python bench/load.py            # 1,000,000 rows
    python bench/load.py --quick    # 100,000 rows; under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.graph import StageGraph
from flowrl.index import Index
from flowrl.pipeline import SOURCE_FIELDS, PipelineSpec, PoolSpec, grpo_stages
from flowrl.registry import Registry
from transport.codec import decode, encode

ROLLOUT_FIELDS = ("prompt_ids", "response_ids", "rollout_logprobs")

# Modelled costs of the store run: short responses so that it takes seconds.
SIM_COST = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}


# ---- index ---------------------------------------------------------------------------------------


def _graph(group_size: int) -> StageGraph:
    return StageGraph(grpo_stages(group_size=group_size), SOURCE_FIELDS)


def _no_handles(n: int, task_no: int) -> dict[str, list[Any]]:
    return {f: [None] * n for f in ROLLOUT_FIELDS}


def _wire_handles(n: int, task_no: int) -> dict[str, list[Any]]:
    """What a rollout task's ``task_done`` carries: one segment per field, a handle per row
    (node, segment, offset, dtype, shape), through the real codec."""
    fields = {f: [["node0", f"flowrl-1a2b3c4d-{task_no}-{f}", i * 512, "int64", [64]]
                  for i in range(n)] for f in ROLLOUT_FIELDS}
    return dict(decode(encode(fields)))


def _fill(index: Index, n_groups: int, group_size: int,
          handles: Callable[[int, int], dict[str, list[Any]]]) -> None:
    """Admit ``n_groups`` groups and run rollout and reward on all of them."""
    for pos in range(n_groups):
        index.add_group(group_size, fields={"prompt": [pos] * group_size})
    task_no = 0
    while (task := index.request("rollout")) is not None:
        n = len(task.rows)
        index.complete(task.id, handles(n, task_no), version=0, lengths=[64] * n)
        task_no += 1
    while (task := index.request("reward")) is not None:
        index.complete(task.id, {"reward": [0.5] * len(task.rows)})


def _train_all(index: Index) -> None:
    while (task := index.request("train", min_version=0)) is not None:
        index.complete(task.id)


def index_memory(n_rows: int, *, group_size: int = 8, wire: bool = False) -> dict[str, float]:
    """Traced bytes per row held (all fields ready, waiting for training) and bytes left once
    every row retired, both above the empty index's baseline."""
    index = Index(_graph(group_size))
    n_groups = n_rows // group_size
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        _fill(index, n_groups, group_size, _wire_handles if wire else _no_handles)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        stats = index.statistics()
        if stats.stages["train"].ready != n_groups * group_size:
            raise RuntimeError(f"rows are not all waiting for training: {stats}")
        _train_all(index)
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    sizes = index.audit()
    if sizes["rows"] or sizes["groups"] or index.statistics().retired_total != n_rows:
        raise RuntimeError(f"rows left after training: {sizes}")
    return {"rows": n_groups * group_size, "bytes_per_row": held / (n_groups * group_size),
            "retained_bytes": retained}


def index_rate(n_rows: int, *, group_size: int = 8, train_groups: int = 2) -> float:
    """Rows per second through admit → rollout → reward → train → retire, streamed in steps of
    64 groups (a bounded window, as the staleness gate keeps it)."""
    index = Index(_graph(group_size))
    n_groups = n_rows // group_size
    window = 64
    t0 = time.perf_counter()
    for first in range(0, n_groups, window):
        _fill_window(index, first, min(window, n_groups - first), group_size)
        while (task := index.request("train", train_groups, min_version=0)) is not None:
            index.complete(task.id)
    dt = time.perf_counter() - t0
    if index.statistics().retired_total != n_groups * group_size:
        raise RuntimeError("rows left after the stream")
    return n_groups * group_size / dt


def _fill_window(index: Index, first: int, count: int, group_size: int) -> None:
    for pos in range(first, first + count):
        index.add_group(group_size, fields={"prompt": [pos] * group_size})
    while (task := index.request("rollout")) is not None:
        n = len(task.rows)
        index.complete(task.id, _no_handles(n, 0), version=0, lengths=[64] * n)
    while (task := index.request("reward")) is not None:
        index.complete(task.id, {"reward": [0.5] * len(task.rows)})


# ---- registry ------------------------------------------------------------------------------------


def registry_churn(workers: int = 256, rounds: int = 20) -> dict[str, Any]:
    """Register, load, and remove ``workers`` workers per round; traced bytes after each round
    (the first round is warm-up: dict tables grow to their working size there)."""
    reg = Registry(10.0)
    roles = ("rollout", "reward", "reference", "train")
    after: list[int] = []
    max_size = 0
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        task_id = 0
        for r in range(rounds):
            infos = [reg.register(name=f"w{r}.{i}", role=roles[i % len(roles)], node="node0",
                                  pid=10_000 + i, capacity=2, version=r, now=float(r))
                     for i in range(workers)]
            max_size = max(max_size, len(reg))
            for info in infos:
                for _ in range(3):
                    reg.assign(info, task_id, 16)
                    task_id += 1
                reg.heartbeat(info.worker_id, float(r) + 0.5)
            for role in roles:
                while (w := reg.least_loaded(role)) is not None and w.in_flight < 4:
                    reg.assign(w, task_id, 1)
                    task_id += 1
            for info in infos:
                for tid in list(info.tasks):
                    reg.finish(info, tid, ok=True)
                reg.remove(info.worker_id)
            if len(reg):
                raise RuntimeError(f"round {r}: {len(reg)} workers left")
            del infos
            gc.collect()
            after.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    return {"workers": workers, "rounds": rounds, "max_size": max_size, "final_size": len(reg),
            "bytes_after_round": after, "growth_bytes": after[-1] - after[0]}


# ---- store at capacity ---------------------------------------------------------------------------


def store_spec(capacity_bytes: int) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=2, per_process=2), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=1, engine="sim", engine_config=SIM_COST,
        store_capacity_bytes=capacity_bytes, heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


async def store_at_capacity(capacity_bytes: int, *, steps: int = 6,
                            timeout_s: float = 20.0) -> dict[str, Any]:
    """Run ``steps`` steps with a store of ``capacity_bytes``: whether it completed, or the
    error that stopped it (``error``, after ``wall_s``); the peak store use seen in
    ``status()``; how often and how long admission paused for the store."""
    from flowrl.controller import Controller, RunError

    peak = 0
    paused_seen = False
    error: str | None = None
    async with Controller(store_spec(capacity_bytes)) as ctl:
        def watch(_: dict[str, Any]) -> None:
            nonlocal peak, paused_seen
            status = ctl.status()
            peak = max(peak, int((status.get("store") or {}).get("used_bytes") or 0))
            paused_seen |= bool(status.get("admission_paused_for_store"))

        ctl.on_step.append(watch)
        t0 = time.perf_counter()
        out: dict[str, Any] = {"version": ctl.version, "samples": None,
                               "rows_trained_twice": None}
        try:
            out = await ctl.run(steps, timeout_s=timeout_s)
            completed = True
        except TimeoutError:
            completed = False
            error = f"timed out after {timeout_s}s at version {ctl.version}"
        except RunError as exc:
            completed = False
            error = str(exc)
        wall = time.perf_counter() - t0
        out["version"] = ctl.version
        status = ctl.status()
    bp = status["store_backpressure"]
    return {"capacity_bytes": capacity_bytes, "completed": completed, "error": error,
            "wall_s": round(wall, 3), "version": out["version"], "samples": out["samples"],
            "rows_trained_twice": out["rows_trained_twice"], "errors": len(status["errors"]),
            "peak_used_bytes": peak,
            "admission_paused_for_store": paused_seen or bp["pauses"] > 0,
            "pauses": bp["pauses"], "paused_s": bp["paused_s"]}


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100,000 rows (under a minute)")
    ap.add_argument("--rows", type=int, help="index rows (default 1,000,000; 100,000 quick)")
    ap.add_argument("--no-store", action="store_true", help="skip the store runs")
    ap.add_argument("--store-kib", type=int, default=32,
                    help="capacity of the store that must complete (KiB; default 32)")
    args = ap.parse_args()
    rows = args.rows or (100_000 if args.quick else 1_000_000)
    mem = index_memory(rows)
    wire = index_memory(rows // 4 if args.quick else rows, wire=True)
    rate = index_rate(rows)
    churn = registry_churn(256, 10 if args.quick else 50)
    out: dict[str, Any] = {
        "bench": "load", "rows": rows,
        "index_bytes_per_row": round(mem["bytes_per_row"], 1),
        "index_bytes_per_row_wire": round(wire["bytes_per_row"], 1),
        "index_retained_bytes": int(mem["retained_bytes"]),
        "index_rows_per_s": round(rate),
        "registry_workers": churn["workers"], "registry_rounds": churn["rounds"],
        "registry_final_size": churn["final_size"],
        "registry_growth_bytes": churn["growth_bytes"],
    }
    if not args.no_store:
        store = asyncio.run(store_at_capacity(args.store_kib << 10,
                                              timeout_s=15.0 if args.quick else 30.0))
        out |= {f"store_{k}": v for k, v in store.items()}
        small = asyncio.run(store_at_capacity(16 << 10, steps=2, timeout_s=30.0))
        out |= {"store_small_completed": small["completed"], "store_small_error": small["error"],
                "store_small_s": small["wall_s"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
