"""Index throughput: rows per second through the whole lifecycle of a 4-stage GRPO graph.

Every row is admitted with its prompt, then for each stage requested, completed with the stage's
produced fields, and finally retired; the figure counts rows that went all the way through.
Prints one JSON line. `bench_index(n_rows)` is importable by other benchmarks.

    python bench/index.py [--rows N] [--group-size G] [--micro-batch B]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index


def grpo_graph(micro_batch: int = 32, group_size: int = 8) -> StageGraph:
    """rollout → reward → advantage (whole groups) → train."""
    return StageGraph(
        [
            StageSpec("rollout", ("prompt",), ("response", "logprobs"), micro_batch),
            StageSpec("reward", ("response",), ("reward",), micro_batch),
            StageSpec("advantage", ("reward",), ("advantages",),
                      max(1, micro_batch // group_size), group_level=True),
            StageSpec("train", ("response", "logprobs", "advantages"), (), micro_batch,
                      consumes_version_bound=True),
        ],
        source_fields=("prompt",),
    )


def bench_index(n_rows: int, *, group_size: int = 8, micro_batch: int = 32) -> float:
    """Rows per second through add → put → request/complete for 4 stages → retire."""
    graph = grpo_graph(micro_batch, group_size)
    index = Index(graph)
    order = [s.name for s in graph.order]
    produces = {s.name: s.produces for s in graph.order}
    n_groups = max(1, n_rows // group_size)
    admit_chunk = max(1, 4 * micro_batch // group_size)  # keep a few micro-batches in flight
    freed = 0
    handle = 0
    t0 = time.perf_counter()
    admitted = 0
    while admitted < n_groups or index.statistics().rows:
        for _ in range(min(admit_chunk, n_groups - admitted)):
            index.add_group(group_size, {"prompt": list(range(handle, handle + group_size))},
                            lengths=[16] * group_size)
            handle += group_size
            admitted += 1
        for name in order:
            while (task := index.request(name, min_version=0 if name == "train" else None)):
                n = len(task.rows)
                out = {f: list(range(handle, handle + n)) for f in produces[name]}
                handle += n * len(out)
                freed += len(index.complete(task.id, out, version=0 if name == "rollout" else None,
                                            lengths=[48] * n if name == "rollout" else None))
    dt = time.perf_counter() - t0
    stats = index.statistics()
    rows = n_groups * group_size
    if stats.retired_total != rows or freed != handle or index.audit()["rows"]:
        raise RuntimeError(f"lifecycle incomplete: {stats}")
    return rows / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=32)
    args = ap.parse_args()
    rate = bench_index(args.rows, group_size=args.group_size, micro_batch=args.micro_batch)
    print(json.dumps({"bench": "index", "rows": args.rows, "group_size": args.group_size,
                      "micro_batch": args.micro_batch, "stages": 4,
                      "rows_per_s": round(rate)}))


if __name__ == "__main__":
    main()
