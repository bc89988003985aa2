"""vLLM rollout against the built-in HF engine on the tiny model, same CPU, same work.

Runs in the vLLM venv (``make test-vllm`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python bench/vllm_engine.py [--quick] [--threads 2] [--batch 32]
                                               [--new-tokens 32]

Prints one JSON line:

- ``hf_tokens_per_s`` / ``vllm_tokens_per_s``: generated tokens ÷ wall time of
  `RolloutEngine.generate` for the same prompts (``--batch`` random prompts of 16 tokens),
  ``--new-tokens`` new tokens each, temperature 1, top-p 1, one response per prompt; best of
  ``--rounds`` calls after a warm-up call. Both engines run in this process with the same torch
  thread count (``--threads``); ``vllm_over_hf`` is their ratio.
- ``vllm_weight_reload_ms``: one `VLLMRolloutEngine.load_weights` of the full weight dict
  (names and shapes checked, vLLM's in-place reload, CPU repacking), best of ``--reloads``,
  alternating two models' weights so every reload changes every tensor;
  ``vllm_weight_reload_ms_median`` the median.
- ``vllm_start_s``: constructing the engine (``vllm.LLM`` in-process, model load, KV cache).
- ``swap_keep_kv_ms`` / ``swap_rebuild_kv_ms``: `VLLMBatcher.swap` of the full weights while
  ``--swap-rows`` requests run (contexts of 300 tokens plus what they generated), median of
  ``--swaps``, with the running requests' KV cache kept or recomputed; ``*_next_token_ms``
  adds the wait until every running request has its next token (the rebuild's prefill happens
  there); ``decode_step_ms`` is a step of the same batch without a swap.

``--quick``: 2 rounds and 10 reloads (under a minute with vLLM's import).
"""

from __future__ import annotations

import argparse
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


def _tokens_per_s(engine: Any, prompts: list[list[int]], params: Any, rounds: int) -> float:
    engine.generate(prompts, params)  # warm-up: allocations, kernel selection
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        gens = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        best = max(best, sum(len(g.response_ids) for g in gens) / elapsed)
    return best


async def _swaps(engine: Any, states: list[Any], rows: int, swaps: int, *,
                 rebuild_kv: bool) -> tuple[float, float, float]:
    """Median ms of a swap, of a swap until every running request's next token, and of a
    decode step without a swap, with ``rows`` requests running."""
    import asyncio

    import torch

    from workers.engines import SamplingParams
    from workers.engines.vllm_continuous import VLLMBatcher

    batcher = VLLMBatcher(engine)
    gen = torch.Generator().manual_seed(1)
    contexts = torch.randint(2, 1000, (rows, 300), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=100)
    stats = batcher.stats

    async def until(done: Any) -> None:  # the driver runs in its own thread: poll it
        deadline = time.monotonic() + 120
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the batcher made no progress in 120 s")
            await asyncio.sleep(0.0005)

    async def tokens_after(count: int) -> None:
        await until(lambda: stats.rows >= count)

    swap_ms, next_ms, step_ms = [], [], []
    for i in range(swaps):
        tasks = [asyncio.create_task(batcher.generate(c, params, stream_key=i * rows + j))
                 for j, c in enumerate(contexts)]
        await tokens_after(stats.rows + rows * 4)  # prefilled, a few tokens each
        t0 = time.perf_counter()
        await tokens_after(stats.rows + rows)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        n = await batcher.swap(lambda i=i: engine.load_weights(states[i % 2], 100 + i),
                               rebuild_kv=rebuild_kv)
        swap_ms.append((time.perf_counter() - t0) * 1e3)
        # The driver has not stepped since the swap: it needs this event loop to.
        await tokens_after(stats.rows + n)
        next_ms.append((time.perf_counter() - t0) * 1e3)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await until(lambda: not batcher.running)  # the driver aborts the cancelled requests
    med = statistics.median
    return round(med(swap_ms), 1), round(med(next_ms), 1), round(med(step_ms), 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Before torch and vLLM load: one thread budget for both engines, vLLM in-process and
    # quiet (its log lines would otherwise share stdout with the JSON line).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import torch

    torch.set_num_threads(args.threads)
    from flowrl.tiny_model import build_tiny_model
    from workers.engines import HFRolloutEngine, SamplingParams
    from workers.engines.vllm_rollout import VLLMRolloutEngine

    with tempfile.TemporaryDirectory(prefix="flowrl-bench-vllm-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        other = build_tiny_model(Path(tmp) / "other", seed=1)
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(2, 1000, (args.batch, 16), generator=gen).tolist()
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens)

        hf = HFRolloutEngine(model, device="cpu", seed=0)
        hf_tps = _tokens_per_s(hf, prompts, params, args.rounds)
        del hf

        t0 = time.perf_counter()
        engine = VLLMRolloutEngine(model, seed=0)
        start_s = time.perf_counter() - t0
        vllm_tps = _tokens_per_s(engine, prompts, params, args.rounds)

        from safetensors.torch import load_file

        states = [load_file(str(d / "model.safetensors")) for d in (other, model)]
        times = []
        for i in range(args.reloads):
            t0 = time.perf_counter()
            engine.load_weights(states[i % 2], i + 1)
            times.append((time.perf_counter() - t0) * 1e3)
        import asyncio
        import importlib

        keep = asyncio.run(_swaps(engine, states, args.swap_rows, args.swaps, rebuild_kv=False))
        rebuild = asyncio.run(_swaps(engine, states, args.swap_rows, args.swaps,
                                     rebuild_kv=True))
        vllm_version = str(importlib.import_module("vllm").__version__)
        return {
            "hf_tokens_per_s": round(hf_tps),
            "vllm_tokens_per_s": round(vllm_tps),
            "vllm_over_hf": round(vllm_tps / hf_tps, 2),
            "vllm_weight_reload_ms": round(min(times), 1),
            "vllm_weight_reload_ms_median": round(statistics.median(times), 1),
            "vllm_start_s": round(start_s, 2),
            "swap_keep_kv_ms": keep[0], "swap_keep_kv_next_token_ms": keep[1],
            "swap_rebuild_kv_ms": rebuild[0], "swap_rebuild_kv_next_token_ms": rebuild[1],
            "decode_step_ms": keep[2], "swap_rows": args.swap_rows,
            "weights_mb": round(sum(t.numel() * t.element_size()
                                    for t in states[0].values()) / 2**20, 2),
            "threads": args.threads, "batch": args.batch, "new_tokens": args.new_tokens,
            "rounds": args.rounds, "reloads": args.reloads, "vllm_version": vllm_version,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--reloads", type=int, default=None)
    p.add_argument("--swap-rows", type=int, default=16)
    p.add_argument("--swaps", type=int, default=None)
    args = p.parse_args()
    args.swaps = args.swaps or (3 if args.quick else 7)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.reloads = args.reloads or (10 if args.quick else 30)
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
