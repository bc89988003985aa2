"""Bucketed weight export from FSDP2 shards vs one whole gather: peak extra memory and time.
Prints one JSON line.

Two gloo ranks (processes) hold a Qwen2 model FSDP2-sharded (``--quick``: 8 layers of 256,
~5M parameters; default: 8 layers of 512, ~19M; a small vocabulary, so that no single tensor
outweighs a bucket). Rank 0 exports the whole weights into a destination allocated and
touched beforehand (what the node's store or an engine holds), either by one whole gather
(`TorchTrainerEngine.export_weights`, then a copy) or in ``n`` buckets
(`TorchTrainerEngine.export_bucketed`, `workers.resharding`); rank 1 takes part in the
gathers. Figures, the worst of both ranks over the repeats:

- ``reshard_peak_extra_share``: the peak resident memory above the process's before the
  export (``VmHWM`` reset through ``/proc/self/clear_refs``; glibc's mmap threshold is fixed
  so that freed buffers leave the process), divided by the model's bytes, with the most
  buckets measured; ``reshard_peak_extra_share_whole``: the same for one whole gather (about
  1: a second model), and ``_<n>`` for each bucket count; ``reshard_bucket_share``: the
  largest bucket's bytes over the model's (the target is at most 1.5 times it: the peak is
  one bucket plus the gather's scratch for one tensor, so a model with a large single tensor
  needs buckets of several times it).
- ``reshard_vs_gather_time``: the median time of the bucketed export over the whole gather's.
- ``reshard_bit_equal``: the bucketed export equals the whole gather bit for bit.

`measure_reshard` is the measurement as a function (other benchmarks call it).

    python bench/reshard.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402

from workers.engines.torch_trainer import TorchTrainerEngine  # noqa: E402
from workers.resharding import copy_into  # noqa: E402

#: the bucket counts the benchmark measures by default.
BUCKETS = (1, 16)
WORLD = 2


def build(path: Path, *, hidden: int, layers: int) -> None:
    """A random Qwen2 model whose largest tensor is a small share of it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def _kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return int(match.group(1)) << 10


def _peak_extra(run: Any) -> tuple[int, float]:
    """(peak resident bytes above the current ones while ``run()`` runs, its seconds)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    base = _kib("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    return max(0, _kib("VmHWM") - base), seconds


def _wait_for(go: Path) -> None:
    """Says this rank is ready (``<go>.ready<rank>``), then waits until ``go`` exists (the
    parent's signal to measure; polled, an idle wait)."""
    Path(f"{go}.ready{dist.get_rank()}").touch()
    while not go.exists():
        time.sleep(0.02)


def rank_main(rank: int, store: str, model: str, buckets: Sequence[int], repeats: int,
              out: str, go: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        engine = TorchTrainerEngine(model, device="cpu")
        engine.shard()
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in engine.export_weights().items()}
        model_bytes = sum(math.prod(s) * d.itemsize for s, d in shapes.values())
        # The destination exists and is touched before any measurement: it is where the
        # weights go (the store, an engine), not memory the export adds.
        dest = {n: torch.ones(s, dtype=d) for n, (s, d) in shapes.items()} if rank == 0 else {}

        into_dest = copy_into(dest) if rank == 0 else (lambda bucket: None)
        _wait_for(Path(go))  # what came before (imports, the load, the shards) is not measured

        def whole() -> None:
            into_dest(engine.export_weights())

        def bucketed(n: int) -> Any:
            size = -(-model_bytes // n)
            return lambda: engine.export_bucketed(size, into_dest)

        runs = {"whole": whole, **{str(n): bucketed(n) for n in buckets}}
        peaks: dict[str, list[int]] = {k: [] for k in runs}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeats + 1):  # the first round warms up (allocator, gloo buffers)
            for key, run in runs.items():
                dist.barrier()
                peak, seconds = _peak_extra(run)
                peaks[key].append(peak)
                times[key].append(seconds)
        # Bit for bit: the most buckets against one whole gather.
        most = max(buckets)
        collected: dict[str, Tensor] = {}
        made = engine.export_bucketed(-(-model_bytes // most), collected.update)
        reference = engine.export_weights()
        equal = (list(collected) == list(reference)
                 and all(collected[n].dtype == v.dtype and torch.equal(collected[n], v)
                         for n, v in reference.items()))
        largest = max(math.prod(s) * d.itemsize for s, d in shapes.values())
        result = {"model_bytes": model_bytes, "largest_tensor_bytes": largest,
                  "peak": {k: max(v[1:]) for k, v in peaks.items()},
                  "seconds": {k: statistics.median(v[1:]) for k, v in times.items()},
                  "equal": equal, "buckets_made": made}
        Path(f"{out}.{rank}").write_text(json.dumps(result))
        # Both ranks done with every collective before either tears gloo down: a rank whose
        # peer closed the pairs under its last gather's loose ends aborted at exit (once in a
        # test run: "terminate called without an active exception", exit -6).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_reshard(model: Path, *, buckets: Sequence[int] = BUCKETS, repeats: int = 3,
                    tmp: Path | None = None, timeout_s: float = 600.0,
                    go: threading.Event | None = None,
                    ready: threading.Event | None = None) -> dict[str, Any]:
    """Run the two ranks on the model at ``model`` and return the figures (module docstring):
    ``reshard_peak_extra_share`` (with ``max(buckets)``), ``reshard_vs_gather_time``, and
    the per-count shares.

    With ``go``, the ranks start (import torch, load and shard the model) at once but measure
    only once ``go`` is set, so that a caller can overlap their start-up with its own and
    still measure them alone (``timeout_s`` then counts from ``go``); ``ready`` is set once
    both have started (or one has exited), so that the caller can keep its own timed work
    out of their start-up."""
    if not buckets or min(buckets) < 1:
        raise ValueError(f"bucket counts must be >= 1, got {list(buckets)}")
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-reshard-", dir=tmp) as d:
        out = Path(d) / "result"
        go_file = Path(d) / "go"
        if go is None:
            go_file.touch()
        # A fixed mmap threshold: large buffers are mapped and unmapped, so a freed bucket
        # leaves the process and the next one shows up in the resident size again.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        procs = [subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "rank", str(r), str(Path(d) / "store"),
             str(model), ",".join(map(str, buckets)), str(repeats), str(out), str(go_file)],
            env=env) for r in range(WORLD)]
        try:
            if go is not None:
                started = [Path(f"{go_file}.ready{r}") for r in range(WORLD)]
                while not all(f.exists() for f in started) and all(
                        p.poll() is None for p in procs):
                    time.sleep(0.05)
                if ready is not None:
                    ready.set()
                go.wait()
                go_file.touch()
            codes = [p.wait(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0] * WORLD:
            raise RuntimeError(f"reshard ranks exited with {codes}")
        results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(WORLD)]
    model_bytes: int = results[0]["model_bytes"]
    most = str(max(buckets))

    def share(key: str) -> float:
        peak: int = max(r["peak"][key] for r in results)
        return round(peak / model_bytes, 4)

    seconds = results[0]["seconds"]
    figures: dict[str, Any] = {
        "reshard_model_mb": round(model_bytes / (1 << 20), 1),
        "reshard_buckets": max(buckets),
        "reshard_bucket_share": round(max(1 / max(buckets),
                                          results[0]["largest_tensor_bytes"] / model_bytes), 4),
        "reshard_peak_extra_share": share(most),
        "reshard_peak_extra_share_whole": share("whole"),
        **{f"reshard_peak_extra_share_{n}": share(str(n)) for n in buckets},
        "reshard_vs_gather_time": round(seconds[most] / seconds["whole"], 3),
        "reshard_gather_ms": round(seconds["whole"] * 1e3, 1),
        "reshard_bucketed_ms": round(seconds[most] * 1e3, 1),
        "reshard_bit_equal": all(r["equal"] for r in results),
    }
    return figures


def main(quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-reshard-model-") as d:
        model = Path(d) / "model"
        hidden, layers = (256, 8) if quick else (512, 8)
        build(model, hidden=hidden, layers=layers)
        return measure_reshard(model, repeats=1 if quick else 5)


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4],
                  [int(b) for b in sys.argv[5].split(",")], int(sys.argv[6]), sys.argv[7],
                  sys.argv[8])
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--quick", action="store_true", help="a smaller model, 1 repeat")
        print(json.dumps(main(parser.parse_args().quick)))
