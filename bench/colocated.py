"""Placement benchmark: colocated (trainer and rollout engine in one process, weights served in
place) against separated (a process each, weights through the store), on the default recipe
(recipes/tiny_cpu.py) on the same cores.

    python bench/colocated.py [--quick] [--steps N] [--set KEY=VALUE ...]

Keys (each measurement adds its own; `MEASUREMENTS` lists them in order):

- ``samples_per_s_colocated``, ``samples_per_s_separated``: trained samples per second of
  `Controller.run` (process start-up and the model build are not timed), at the recipe's
  ``max_staleness`` (``max_staleness``); the colocated run holds one weight copy
  (``placement.keep_weight_copy = false``).
- ``rss_peak_mb_colocated``, ``rss_peak_mb_separated``: the highest sum, sampled every 50 ms
  during the run, of the resident memory of the processes that hold the policy (trainer and
  rollout workers); ``pss_peak_mb_*``: the same with proportional set sizes (shared pages
  counted once across processes, so the store's pages a process maps are not counted twice).
- ``weight_sync_ms_colocated``, ``weight_sync_ms_separated``: one new version made servable,
  best of ``rounds``, in this process on the recipe's model: separated, the trainer's export,
  its write into a real store and the rollout engine's load of the store's read-only views
  (what a step end and a rollout worker do); colocated, the rollout role's ``load_version``
  and ``serve_in_place`` over the trainer's module (a version bump).
- ``serving_copies_separated``, ``serving_copies_colocated``: the weight copies this process
  holds once a rollout engine serves the trainer's weights, on a larger model
  (``weight_mb_large``): 1 (the trainer's) plus the resident growth over the weights' size,
  freed memory handed back first (``malloc_trim``) so that only live tensors count.

Other keys: ``steps``, ``max_staleness``, ``quick``, ``cpus``, and each measurement's seconds
(``placements_s``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.runner import run_and_print
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
QUICK_STEPS = 10
MB = float(1 << 20)
#: the roles whose processes hold the policy's weights
POLICY_ROLES = ("rollout", "train")


# ---- runs --------------------------------------------------------------------------------------


async def _sample_memory(pids: Callable[[], list[int]], peak: dict[str, float],
                         stop: asyncio.Event) -> None:
    """Until ``stop``: the highest summed RSS and PSS of ``pids()``, every 50 ms."""
    while not stop.is_set():
        rss = pss = 0.0
        for pid in pids():
            with contextlib.suppress(psutil.Error):
                info = psutil.Process(pid).memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
        peak["rss"] = max(peak.get("rss", 0.0), rss)
        peak["pss"] = max(peak.get("pss", 0.0), pss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


async def run_placement(recipe: Recipe, mode: str) -> dict[str, float]:
    """Train ``recipe.steps`` steps placed by ``mode``: rate and peak memory."""
    from flowrl.controller import Controller
    from flowrl.run import compile_recipe

    placed = recipe if mode == "separated" else apply_overrides(
        recipe, [(("placement", "mode"), mode), (("placement", "keep_weight_copy"), False)],
        file=str(RECIPE))
    spec = await asyncio.to_thread(compile_recipe, placed)
    async with Controller(spec) as ctl:
        peak: dict[str, float] = {}
        stop = asyncio.Event()
        pids = lambda: sorted({p for r in POLICY_ROLES for p in ctl.worker_pids(r)})  # noqa: E731
        sampler = asyncio.ensure_future(_sample_memory(pids, peak, stop))
        try:
            summary = await ctl.run(recipe.steps)
        finally:
            stop.set()
            await sampler
    return {"samples_per_s": float(summary["samples_per_s"]), "rss_peak_mb": peak["rss"] / MB,
            "pss_peak_mb": peak["pss"] / MB}


async def placements(recipe: Recipe, model_dir: Path, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("separated", "colocated"):
        run = await run_placement(recipe, mode)
        out.update({f"{k}_{mode}": round(v, 1) for k, v in run.items()})
    return out


# ---- weight sync -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _store(nbytes: int) -> Any:
    """A real node store and two clients of it (the trainer's and a rollout worker's)."""
    from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir, run_dir
    from transport.store import SampleStore
    from transport.store_client import StoreClient
    from transport.store_server import StoreServer

    run_id = new_run_id()
    run_dir(run_id)
    store = SampleStore(run_id, "node0", capacity_bytes=max(64 << 20, 4 * nbytes))
    try:
        async with StoreServer(store, ipc_endpoint(run_id, "store")) as server, \
                StoreClient(run_id, "node0", server.endpoint) as writer, \
                StoreClient(run_id, "node0", server.endpoint) as reader:
            yield writer, reader
    finally:
        store.close()
        remove_run_dir(run_id)


async def weight_sync(recipe: Recipe, model_dir: Path, quick: bool) -> dict[str, Any]:
    import torch

    from transport.handles import Handle
    from workers.colocated import ColocatedRollout
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.factory import make_colocated_roles
    from workers.runtime import fetch_weights, publish_weights

    torch.set_num_threads(1)  # a worker's copy runs on one thread
    rounds = 10 if quick else 50
    trainer = TorchTrainerEngine(model_dir)
    rollout = HFRolloutEngine(model_dir)
    nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    separated = []
    async with _store(nbytes) as (writer, reader):
        previous: dict[str, list[Any]] = {}
        for version in range(1, rounds + 1):
            t0 = time.perf_counter()
            wire = await publish_weights(writer, trainer.export_weights())
            rollout.load_weights(await fetch_weights(reader, wire), version, shared=True)
            separated.append(time.perf_counter() - t0)
            await reader.free([Handle.from_wire(h) for h, _shape in previous.values()])
            previous = wire
        await reader.free([Handle.from_wire(h) for h, _shape in previous.values()])
    config = placed_config(recipe, model_dir)
    train, generate = make_colocated_roles(config, 0, keep_weight_copy=False)
    assert isinstance(generate, ColocatedRollout)
    colocated = []
    for version in range(1, rounds + 1):
        train.role.version = version  # type: ignore[attr-defined]  # as a step end leaves it
        t0 = time.perf_counter()
        await generate.load_version(version, {})
        generate.engine.serve_in_place(version)
        colocated.append(time.perf_counter() - t0)
    return {"weight_sync_ms_separated": round(min(separated) * 1e3, 3),
            "weight_sync_ms_colocated": round(min(colocated) * 1e3, 4),
            "weight_mb": round(nbytes / MB, 2)}


def placed_config(recipe: Recipe, model_dir: Path) -> Any:
    """The recipe's engine spec on ``model_dir``."""
    spec = recipe.engine_spec()
    return spec.model_copy(update={"model": spec.model.model_copy(
        update={"path": str(model_dir)})})


async def serving_copies(recipe: Recipe, model_dir: Path, quick: bool) -> dict[str, Any]:
    """Weight copies held once a rollout engine serves the trainer's weights, separated (the
    store's copy, read in place by the engine) and colocated (the trainer's module)."""
    from flowrl.tiny_model import build_tiny_model
    from workers.colocated import rss_bytes
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.runtime import fetch_weights, publish_weights

    with tempfile.TemporaryDirectory(prefix="flowrl-colocated-") as tmp:
        hidden = 256 if quick else 768
        big = await asyncio.to_thread(build_tiny_model, Path(tmp) / "model", hidden=hidden,
                                      layers=8, heads=8, kv_heads=4)
        trainer = TorchTrainerEngine(big)
        nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        _trim()
        before = rss_bytes()
        HFRolloutEngine(big, model=trainer.model).serve_in_place(1)
        colocated = 1 + (rss_bytes() - before) / nbytes
        async with _store(nbytes) as (writer, reader):
            before = rss_bytes()
            wire = await publish_weights(writer, trainer.export_weights())
            engine = HFRolloutEngine(big)
            engine.load_weights(await fetch_weights(reader, wire), 1, shared=True)
            _trim()
            # Resident now: the store's copy (written here, read in place by the engine).
            separated = 1 + (rss_bytes() - before) / nbytes
            del engine
    return {"serving_copies_separated": round(separated, 2),
            "serving_copies_colocated": round(colocated, 2),
            "weight_mb_large": round(nbytes / MB, 1)}


def _trim() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc), so that resident
    memory counts live tensors, not what the allocator keeps for reuse."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


#: what the benchmark measures, in order: each takes the recipe, its model and ``--quick``
#: and returns its keys
MEASUREMENTS: list[Callable[[Recipe, Path, bool], Awaitable[dict[str, Any]]]] = [
    placements, weight_sync, serving_copies,
]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    steps = args.steps or (QUICK_STEPS if args.quick else 40)
    recipe = load_recipe(RECIPE, [*overrides, f"steps={steps}"])
    from flowrl.run import prepare_model

    model_dir = await asyncio.to_thread(prepare_model, recipe)
    assert model_dir is not None
    out: dict[str, Any] = {}
    for measure in MEASUREMENTS:
        t0 = time.perf_counter()
        out.update(await measure(recipe, model_dir, args.quick))
        out[f"{measure.__name__}_s"] = round(time.perf_counter() - t0, 1)
    out.update(steps=steps, max_staleness=recipe.max_staleness, quick=args.quick,
               cpus=os.cpu_count())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps per placement (< 60 s once the model is cached)")
    p.add_argument("--steps", type=int, help="steps per placement (default 40)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the recipe, as the launcher's --set")
    args = p.parse_args()
    configure(level="warning")
    run_and_print(main_async(args))


if __name__ == "__main__":
    main()
