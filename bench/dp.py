"""Data-parallel trainer ranks: what each rank holds, and what a step costs, replicated vs
FSDP2-sharded, against one process. Prints one JSON line.

Two gloo ranks (processes) train a Qwen2 model built from a config (``--quick``: 4 layers of
256, ~5M parameters; default: 8 layers of 512, ~30M) on random token rows: every step is
``MICRO`` micro-batches per rank, gradients accumulated as loss sums, then the step's end as
`workers.roles.dp_trainer` takes it (replicated: one all-reduce of the gradient sums and
counts; sharded: the counts only, the backward having reduce-scattered). One process trains
the same rows of both ranks as the baseline. Figures are medians over the timed steps (after
one warm-up step), all in this run:

- ``state_mb_per_rank_replicate`` / ``_fsdp2``: parameters + gradients + optimizer moments a
  rank holds between passes (local shards when sharded); ``state_ratio_fsdp2`` = the two's
  ratio (ideal 0.5 with two ranks).
- ``step_ms_single``: one process's step on both ranks' rows; ``step_ms_replicate`` /
  ``step_ms_fsdp2``: the ranks' step on half the rows each (rank 0's clock);
  ``step_ms_fsdp2_bf16``: sharded with passes in bfloat16 (``trainer.compute_dtype``);
  ``speedup_replicate`` / ``speedup_fsdp2``: single over each. On 2 shared CPU cores the
  ranks compete for the cores the single process has to itself; sharding adds a gather per
  unit and pass and a reduce-scatter per backward.

    python bench/dp.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor  # noqa: E402

from workers.distributed import all_reduce_counts, all_reduce_step, local_part  # noqa: E402
from workers.engines.protocols import SequenceBatch  # noqa: E402
from workers.engines.torch_trainer import TorchTrainerEngine  # noqa: E402

MICRO = 2
ROWS = 4
PROMPT = 16
RESPONSE = 48


def build(path: Path, quick: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers = (256, 4) if quick else (512, 8)
    config = Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def batch(seed: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4096, (ROWS, PROMPT + RESPONSE), generator=g)
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, PROMPT:] = True
    return SequenceBatch(ids, torch.ones_like(ids), resp)


def loss_sum(lps: Tensor, seqs: SequenceBatch) -> Tensor:
    return -(lps * seqs.response_mask).sum()


def state_bytes(engine: TorchTrainerEngine) -> int:
    total = 0
    for p in engine.model.parameters():
        total += 2 * local_part(p).numel() * p.element_size()  # the parameter and its gradient
        for v in engine.optimizer.state.get(p, {}).values():
            if isinstance(v, Tensor) and v.dim():
                total += local_part(v).numel() * v.element_size()
    return total


def train(engine: TorchTrainerEngine, seeds: list[list[int]], mode: str, steps: int) -> float:
    """Median step time (ms) over ``steps`` after one warm-up step."""
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        tokens = 0
        for seed in seeds[step % len(seeds)]:
            b = batch(seed)
            engine.train_micro_batch(b, loss_sum)
            tokens += b.num_response_tokens
        if mode == "replicate":
            params = [p for p in engine.model.parameters() if p.requires_grad]
            total = all_reduce_step(params, [float(tokens)])[0]
        elif mode.startswith("fsdp2"):
            total = all_reduce_counts([float(tokens)], engine.device)[0]
            scale = float(dist.get_world_size())  # the backward averaged over the ranks
            for p in engine.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        else:
            total = float(tokens)
        for p in engine.model.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        engine.optimizer_step()
        if step:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def rank_main(rank: int, store: str, model: str, mode: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        engine = TorchTrainerEngine(model, lr=1e-4, device="cpu")
        if mode.startswith("fsdp2"):
            engine.shard("bfloat16" if mode == "fsdp2-bf16" else "float32")
        seeds = [[1000 * s + 10 * rank + k for k in range(MICRO)] for s in range(steps + 1)]
        ms = train(engine, seeds, mode, steps)
        result = {"step_ms": ms, "state_bytes": state_bytes(engine)}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        # Both ranks done with every collective before either tears gloo down (as in
        # `bench/reshard.py`): a rank whose peer left first may abort at exit.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def ranks(model: Path, mode: str, steps: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{mode}.json"
    store = tmp / f"{mode}.store"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(store), str(model),
                               mode, str(steps), str(out)], env=env) for r in (0, 1)]
    codes = [p.wait(timeout=900) for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"{mode} ranks exited with {codes}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def single(model: Path, steps: int) -> tuple[float, int]:
    torch.set_num_threads(2)
    engine = TorchTrainerEngine(model, lr=1e-4, device="cpu")
    seeds = [[1000 * s + 10 * r + k for r in (0, 1) for k in range(MICRO)]
             for s in range(steps + 1)]
    return train(engine, seeds, "single", steps), state_bytes(engine)


def main(quick: bool) -> dict[str, Any]:
    steps = 3 if quick else 8
    with tempfile.TemporaryDirectory(prefix="flowrl-bench-dp-") as d:
        tmp = Path(d)
        model = tmp / "model"
        build(model, quick)
        params = sum(p.numel() for p in TorchTrainerEngine(model, device="cpu").model.parameters())
        single_ms, single_bytes = single(model, steps)
        rep = ranks(model, "replicate", steps, tmp)
        fsdp = ranks(model, "fsdp2", steps, tmp)
        bf16 = ranks(model, "fsdp2-bf16", steps, tmp)
    mb = 1 << 20
    return {
        "params_m": round(params / 1e6, 2),
        "state_mb_single": round(single_bytes / mb, 1),
        "state_mb_per_rank_replicate": round(rep["state_bytes"] / mb, 1),
        "state_mb_per_rank_fsdp2": round(fsdp["state_bytes"] / mb, 1),
        "state_ratio_fsdp2": round(fsdp["state_bytes"] / rep["state_bytes"], 3),
        "step_ms_single": round(single_ms, 1),
        "step_ms_replicate": round(rep["step_ms"], 1),
        "step_ms_fsdp2": round(fsdp["step_ms"], 1),
        "step_ms_fsdp2_bf16": round(bf16["step_ms"], 1),
        "speedup_replicate": round(single_ms / rep["step_ms"], 2),
        "speedup_fsdp2": round(single_ms / fsdp["step_ms"], 2),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]),
                  sys.argv[7])
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--quick", action="store_true", help="a small model, 3 steps")
        print(json.dumps(main(parser.parse_args().quick)))
