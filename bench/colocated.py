"""Placement benchmark: colocated (trainer and rollout engine in one process, weights served in
place) against separated (a process each, weights through the store), on the default recipe
(recipes/tiny_cpu.py) on the same cores; and the bucketed weight export from FSDP2 shards
(bench/reshard.py).

    python bench/colocated.py [--quick] [--steps N] [--set KEY=VALUE ...]

Keys (each measurement adds its own; `MEASUREMENTS` lists them in order):

- ``samples_per_s_colocated``, ``samples_per_s_separated``: trained samples per second of
  `Controller.run` (process start-up and the model build are not timed), at the recipe's
  ``max_staleness`` (``max_staleness``); the colocated run holds one weight copy
  (``placement.keep_weight_copy = false``). Both placements' processes (and the resharding
  ranks) start together, most of the benchmark's time being their imports of torch; the
  runs then take turns, each one's workers training while the other's wait idle.
- ``rss_peak_mb_colocated``, ``rss_peak_mb_separated``: the highest sum, sampled every 50 ms
  during the run, of the resident memory of the processes that hold the policy (trainer and
  rollout workers); ``pss_peak_mb_*``: the same with proportional set sizes (shared pages
  counted once across processes, so the store's pages a process maps are not counted twice),
  sampled every 0.5 s (each reading costs the run tens of ms of CPU).
- ``weight_sync_ms_colocated``, ``weight_sync_ms_separated``: one new version made servable,
  best of ``rounds``, in this process on the recipe's model: separated, the trainer's export,
  its write into a real store and the rollout engine's load of the store's read-only views
  (what a step end and a rollout worker do); colocated, the rollout role's ``load_version``
  and ``serve_in_place`` over the trainer's module (a version bump).
- ``serving_copies_separated``, ``serving_copies_colocated``: the weight copies this process
  holds once a rollout engine serves the trainer's weights, on a larger model
  (``weight_mb_large``): 1 (the trainer's) plus the resident growth over the weights' size,
  freed memory handed back first (``malloc_trim``) so that only live tensors count.
- ``reshard_*``: bench/reshard.py's `measure_reshard` (its docstring has the keys): two gloo
  ranks export a Qwen2 model (``--quick``: 256 wide, 8 layers, 18.5 MB, 1 repeat; else 512,
  73 MB, 5 repeats) from FSDP2 shards in 16 buckets and in one whole gather.
  ``reshard_peak_extra_share`` is the peak extra memory over the model's bytes (target at most
  1.5 times ``reshard_bucket_share``), ``reshard_vs_gather_time`` the time over the whole
  gather's. Their start-up overlaps the placements'; they measure after everything else, alone.

Other keys: ``steps``, ``max_staleness``, ``quick``, ``cpus``, ``load_average`` (at the end),
each measurement's seconds (``placements_s``, ...), of which ``start_s`` is the start-up of
the placements' processes and the resharding ranks, and ``total_s``, the script's (less the
interpreter's start and the first imports, under a second).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.runner import run_and_print
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

if TYPE_CHECKING:
    from flowrl.controller import Controller

STARTED = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
QUICK_STEPS = 10
MB = float(1 << 20)
#: the roles whose processes hold the policy's weights
POLICY_ROLES = ("rollout", "train")
MODES = ("separated", "colocated")
#: PSS is read every this many memory samples (every 0.5 s), RSS every 50 ms
PSS_EVERY = 10
#: bench/reshard.py's model (hidden size, layers) and repeats, by ``--quick``
RESHARD_MODEL = {False: (512, 8), True: (256, 8)}
RESHARD_REPEATS = {False: 5, True: 1}


# ---- runs --------------------------------------------------------------------------------------


async def _sample_memory(pids: Callable[[], list[int]], peak: dict[str, float],
                         stop: asyncio.Event) -> None:
    """Until ``stop``: the highest summed RSS of ``pids()``, every 50 ms, and PSS, every
    ``PSS_EVERY`` samples. A PSS reading walks the process's page tables (~30 ms of CPU for
    a 600 MB process): read every 50 ms it took over half a core from the run it measured,
    twice as much for the separated placement's two processes as for the colocated one."""
    sample = 0
    while not stop.is_set():
        with_pss = sample % PSS_EVERY == 0
        rss = pss = 0.0
        for pid in pids():
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if with_pss:
                    info = process.memory_full_info()
                    rss += info.rss
                    pss += getattr(info, "pss", info.rss)
                else:
                    rss += process.memory_info().rss
        peak["rss"] = max(peak.get("rss", 0.0), rss)
        if with_pss:
            peak["pss"] = max(peak.get("pss", 0.0), pss)
        sample += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)


def placed(recipe: Recipe, mode: str) -> Recipe:
    """``recipe`` placed by ``mode`` (colocated: one weight copy)."""
    return recipe if mode == "separated" else apply_overrides(
        recipe, [(("placement", "mode"), mode), (("placement", "keep_weight_copy"), False)],
        file=str(RECIPE))


async def run_placement(ctl: Controller, steps: int) -> dict[str, float]:
    """Train ``steps`` steps on the started ``ctl``: rate and peak memory."""
    peak: dict[str, float] = {}
    stop = asyncio.Event()
    pids = lambda: sorted({p for r in POLICY_ROLES for p in ctl.worker_pids(r)})  # noqa: E731
    sampler = asyncio.ensure_future(_sample_memory(pids, peak, stop))
    try:
        summary = await ctl.run(steps)
    finally:
        stop.set()
        await sampler
    return {"samples_per_s": float(summary["samples_per_s"]), "rss_peak_mb": peak["rss"] / MB,
            "pss_peak_mb": peak["pss"] / MB}


async def placements(ctx: Context) -> dict[str, Any]:
    """Both placements started together (their processes' start-up, mostly importing torch,
    overlaps), then run one after the other: each run's workers train while the other's wait
    idle, the same for both."""
    from flowrl.controller import Controller
    from flowrl.run import compile_recipe

    specs = [await asyncio.to_thread(compile_recipe, placed(ctx.recipe, mode))
             for mode in MODES]
    out: dict[str, Any] = {}
    ctls = [Controller(spec) for spec in specs]
    t0 = time.perf_counter()
    try:
        # Closed together below, started or half-started (as Controller.__aenter__ does).
        entered = await asyncio.gather(*(c.start() for c in ctls), return_exceptions=True)
        for error in entered:
            if isinstance(error, BaseException):
                raise error
        await ctx.reshard.started()  # no process starting while a placement runs
        out["start_s"] = round(time.perf_counter() - t0, 1)
        for mode, ctl in zip(MODES, ctls, strict=True):
            run = await run_placement(ctl, ctx.recipe.steps)
            out.update({f"{k}_{mode}": round(v, 1) for k, v in run.items()})
    finally:
        await asyncio.gather(*(c.aclose() for c in ctls))
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


async def weight_sync(ctx: Context) -> dict[str, Any]:
    import torch

    from transport.handles import Handle
    from workers.colocated import ColocatedRollout
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.roles.factory import make_colocated_roles
    from workers.runtime import fetch_weights, publish_weights

    torch.set_num_threads(1)  # a worker's copy runs on one thread
    rounds = 10 if ctx.quick else 50
    trainer = TorchTrainerEngine(ctx.model_dir)
    rollout = HFRolloutEngine(ctx.model_dir)
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
    config = placed_config(ctx.recipe, ctx.model_dir)
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


async def serving_copies(ctx: Context) -> dict[str, Any]:
    """Weight copies held once a rollout engine serves the trainer's weights, separated (the
    store's copy, read in place by the engine) and colocated (the trainer's module)."""
    from flowrl.tiny_model import build_tiny_model
    from workers.colocated import rss_bytes
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.runtime import fetch_weights, publish_weights

    with tempfile.TemporaryDirectory(prefix="flowrl-colocated-") as tmp:
        hidden = 256 if ctx.quick else 768
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


# ---- resharding --------------------------------------------------------------------------------


class ReshardRanks:
    """bench/reshard.py's two FSDP2 ranks, started at once so that their start-up (importing
    torch, loading and sharding the model) overlaps the placements'; they measure, alone, when
    `figures` is awaited."""

    def __init__(self, quick: bool, tmp: Path) -> None:
        self.quick = quick
        self.tmp = tmp
        self.go = threading.Event()
        self.ready = threading.Event()
        self.task = asyncio.ensure_future(asyncio.to_thread(self._run))

    def _run(self) -> dict[str, Any]:
        from bench.reshard import build, measure_reshard

        hidden, layers = RESHARD_MODEL[self.quick]
        model = self.tmp / "reshard-model"
        build(model, hidden=hidden, layers=layers)
        return measure_reshard(model, repeats=RESHARD_REPEATS[self.quick], tmp=self.tmp,
                               go=self.go, ready=self.ready)

    async def started(self) -> None:
        """Once both ranks are loaded and wait (or the build failed), idle from then on."""
        waiting = asyncio.ensure_future(asyncio.to_thread(self.ready.wait))
        await asyncio.wait([waiting, self.task], return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            self.ready.set()  # ends the waiting thread
            await waiting

    async def figures(self) -> dict[str, Any]:
        self.go.set()
        return await self.task


async def reshard(ctx: Context) -> dict[str, Any]:
    """Bucketed export from FSDP2 shards against one whole gather (`measure_reshard`)."""
    return await ctx.reshard.figures()


# ---- main ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What the measurements share."""

    recipe: Recipe
    model_dir: Path
    quick: bool
    reshard: ReshardRanks


#: what the benchmark measures, in order: each takes the `Context` and returns its keys
MEASUREMENTS: list[Callable[[Context], Awaitable[dict[str, Any]]]] = [
    placements, weight_sync, serving_copies, reshard,
]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    overrides = list(args.overrides)
    steps = args.steps or (QUICK_STEPS if args.quick else 40)
    recipe = load_recipe(RECIPE, [*overrides, f"steps={steps}"])
    from flowrl.run import prepare_model

    model_dir = await asyncio.to_thread(prepare_model, recipe)
    assert model_dir is not None
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="flowrl-colocated-reshard-") as tmp:
        ctx = Context(recipe, model_dir, args.quick, ReshardRanks(args.quick, Path(tmp)))
        try:
            for measure in MEASUREMENTS:
                t0 = time.perf_counter()
                out.update(await measure(ctx))
                out[f"{measure.__name__}_s"] = round(time.perf_counter() - t0, 1)
        finally:
            ctx.reshard.go.set()  # the ranks end (measuring) rather than wait forever
            with contextlib.suppress(Exception):
                await ctx.reshard.task
    out.update(steps=steps, max_staleness=recipe.max_staleness, quick=args.quick,
               cpus=os.cpu_count(), load_average=[round(x, 2) for x in os.getloadavg()],
               total_s=round(time.perf_counter() - STARTED, 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps per placement, a smaller resharding model (< 60 s on "
                        "2 free cores once the model is cached)")
    p.add_argument("--steps", type=int, help="steps per placement (default 40)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the recipe, as the launcher's --set")
    args = p.parse_args()
    configure(level="warning")
    run_and_print(main_async(args))


if __name__ == "__main__":
    main()
