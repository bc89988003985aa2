"""End-to-end benchmark: the default recipe (recipes/tiny_cpu.py) trained for real.

Runs the recipe twice on real processes, a real tiny model and the real task — synchronously
(``max_staleness=0``) and asynchronously (``max_staleness=1``), same seed, same number of
trained samples — then measures weight sync against ``memcpy`` in-process. Prints one JSON line.
With ``--seeds`` the pair of runs is repeated per seed and every run figure is the mean over the
seeds (``*_by_seed`` lists the runs): one run's final reward moves by several percent from seed
to seed, more than the difference between the two modes.

    python bench/e2e.py [--quick] [--small-steps] [--seeds 0,1,2] [--steps N]
                        [--set KEY=VALUE ...] [--vs-trl] [--trl-threads N]

``--small-steps`` runs the recipe at the scale of TRL's GRPO examples instead: groups of 4,
16-token completions, 8 completions per optimizer step (2 groups), each step's completions
generated in one call and trained in one micro-batch — on both sides, so TRL's batching is
matched (``SMALL_STEPS`` lists the overrides; ``--set`` applies after them).

Keys (every rate is trained samples per second of `Controller.run` wall time, from the first
dispatch to the last optimizer step; process start-up and the model build are not timed):

- ``samples_per_s_sync``, ``samples_per_s_async``, ``speedup_async`` (async ÷ sync).
- ``reward_first_sync`` / ``reward_first_async``: mean reward of the first 10 steps;
  ``reward_final_sync`` / ``reward_final_async``: of the last 10 steps (the reward is
  ``workers.roles.builtin_rewards.numeric_partial_credit``: 1.0 for an exact sum).
- ``overhead_share`` (of the async run): CPU seconds spent on orchestration and transport ÷ wall
  seconds, where orchestration and transport are (a) the whole controller process (this one:
  index, scheduler, RPC, the children's log relay), (b) the whole node agent (the store server),
  and (c) in every worker process its event-loop thread and its ZeroMQ I/O threads — which run
  the RPCs, store reads and writes, heartbeats and weight loading hand-offs, while the role's
  compute runs in other threads (rollout generation, training, reward calls). (c) also counts
  the little role code that runs on a worker's loop (tokenizing prompts, detokenizing
  responses), so it is an upper bound. The parts are ``overhead_controller``,
  ``overhead_node`` and ``overhead_workers``; ``overhead_cpu_ms_per_sample`` is the same CPU
  time per trained sample (a share of wall time grows with throughput; this does not).
- ``weight_sync_gbps``: one weight publish and load as the workers do it, in this process: the
  trainer's exported weights are written into the node's store through a `StoreClient`
  (`workers.runtime.publish_weights`: a put into shared memory and its round trips to the
  `StoreServer`), read back as read-only views through a second client (`fetch_weights`) and
  served in place by a rollout engine (`HFRolloutEngine.load_weights(..., shared=True)`, as
  the rollout role loads a version); bytes of the weights ÷ time of that round trip, best of
  the rounds, steady state (each version is freed after the next one is loaded, as the
  controller retires versions, so puts rewrite pooled shared memory). A round trip is one
  copy plus fixed costs (round trips to the store server, looking the segment up), so
  ``memcpy_gbps`` is its ceiling; on the recipe's 4 MB the fixed costs dominate.
- ``memcpy_gbps``: the same tensors copied into preallocated private tensors, best of the rounds.
- ``weight_sync_gbps_large``, ``memcpy_gbps_large``, ``weight_sync_vs_memcpy_large``,
  ``weight_bytes_large``: the same round trip for a larger model built for the purpose (hidden
  1024, 8 layers: ~500 MB of float32 weights; hidden 512, ~128 MB, with ``--quick``), whose
  weights do not fit in the CPU cache, as a real model's do not.
- With ``--vs-trl`` and ``trl`` importable: ``trl_samples_per_s`` (TRL's ``GRPOTrainer`` on the
  CPU on the same job and number of samples, as `bench.trl_peer` sets it up, with
  ``--trl-threads`` torch threads, default 1), ``ratio_vs_trl`` (``samples_per_s_async`` ÷
  it), ``trl_threads`` and ``trl_versions``; otherwise
  ``trl_skipped`` says why. See bench/README.md for running it from a separate venv.

``--quick`` trains 12 steps per mode instead of the recipe's (same keys; the rewards are then
far from converged and say nothing about learning).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.runner import run_and_print, seed_list
from flowrl.logs import configure
from flowrl.recipe import Recipe
from flowrl.recipe_file import apply_overrides, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny_cpu.py"
WINDOW = 10  # steps averaged for the first and final reward
QUICK_STEPS = 12
SMALL_STEPS = (
    "algorithm.group_size=4",
    "rollout.max_new_tokens=16",
    "trainer.groups_per_step=2",
    "trainer.micro_batch_groups=2",
    "rollout.groups_per_task=2",
)


# ---- the RL runs -------------------------------------------------------------------------------


def _thread_comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _children_cpu() -> dict[str, float]:
    """CPU seconds so far of the node agent and of the workers' loop and ZeroMQ threads."""
    node = workers = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
            if "flowrl.node" in cmd:
                t = proc.cpu_times()
                node += t.user + t.system
            elif "workers.main" in cmd:
                for th in proc.threads():
                    if th.id == proc.pid or _thread_comm(proc.pid, th.id).startswith("ZMQbg"):
                        workers += th.user_time + th.system_time
        except psutil.NoSuchProcess:
            continue
    return {"node": node, "workers": workers}


async def run_mode(recipe: Recipe, staleness: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps at ``staleness``; rate, rewards and overhead of the run."""
    from flowrl.controller import Controller
    from flowrl.run import compile_recipe

    mode = apply_overrides(recipe, [(("max_staleness",), staleness)], file=str(RECIPE))
    spec = await asyncio.to_thread(compile_recipe, mode)
    async with Controller(spec) as ctl:
        children0 = _children_cpu()
        cpu0 = time.process_time()
        summary = await ctl.run(steps)
        cpu = time.process_time() - cpu0
        children1 = _children_cpu()
        rewards = [float(e["reward_mean"]) for e in ctl.step_log
                   if e.get("reward_mean") is not None]
    wall = float(summary["wall_s"])
    node = children1["node"] - children0["node"]
    workers = children1["workers"] - children0["workers"]
    return {
        "samples_per_s": float(summary["samples_per_s"]),
        "samples": int(summary["samples"]),
        "wall_s": wall,
        "reward_first": statistics.fmean(rewards[:WINDOW]),
        "reward_final": statistics.fmean(rewards[-WINDOW:]),
        "overhead_controller": cpu / wall,
        "overhead_node": node / wall,
        "overhead_workers": workers / wall,
        "stale_dropped": int(summary["stale_dropped"]),
    }


# ---- weight sync -------------------------------------------------------------------------------


async def weight_sync(model_dir: Path, rounds: int) -> dict[str, float]:
    """Best-of-``rounds`` publish+load round trip, and memcpy of the same tensors."""
    import torch

    from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir, run_dir
    from transport.handles import Handle
    from transport.store import SampleStore
    from transport.store_client import StoreClient
    from transport.store_server import StoreServer
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine
    from workers.runtime import fetch_weights, publish_weights

    torch.set_num_threads(1)  # a worker's copy runs on one thread
    weights = TorchTrainerEngine(model_dir).export_weights()
    rollout = HFRolloutEngine(model_dir)
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())

    copies = {n: torch.empty_like(w) for n, w in weights.items()}
    memcpy = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for n, w in weights.items():
            copies[n].copy_(w)
        memcpy.append(time.perf_counter() - t0)

    run_id = new_run_id()
    run_dir(run_id)
    store = SampleStore(run_id, "node0", capacity_bytes=max(64 << 20, 8 * nbytes))
    sync = []
    try:
        endpoint = ipc_endpoint(run_id, "store")
        # The trainer writes, the rollout worker reads: two clients, as two processes have.
        async with StoreServer(store, endpoint) as server, \
                StoreClient(run_id, "node0", server.endpoint) as trainer, \
                StoreClient(run_id, "node0", server.endpoint) as reader:
            previous: dict[str, list[Any]] = {}
            for version in range(1, rounds + 1):
                t0 = time.perf_counter()
                wire = await publish_weights(trainer, weights)
                rollout.load_weights(await fetch_weights(reader, wire), version, shared=True)
                sync.append(time.perf_counter() - t0)
                # The old version retires once the new one is served (as the controller).
                await reader.free([Handle.from_wire(h) for h, _shape in previous.values()])
                previous = wire
            await reader.free([Handle.from_wire(h) for h, _shape in previous.values()])
    finally:
        store.close()
        remove_run_dir(run_id)
    return {"weight_sync_gbps": nbytes / min(sync) / 1e9,
            "memcpy_gbps": nbytes / min(memcpy) / 1e9, "weight_bytes": float(nbytes)}


# ---- TRL side by side (optional) -------------------------------------------------------------


def trl_side_by_side(recipe: Recipe, model_dir: Path, steps: int, threads: int,
                     ) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same job (`bench.trl_peer`), or ``trl_skipped`` /
    ``trl_error``."""
    from bench import trl_peer

    why = trl_peer.unavailable()
    if why is not None:
        return {"trl_skipped": why}
    try:
        run = trl_peer.run_trl(recipe, model_dir, steps, threads=threads)
    except Exception as e:  # a peer's API drift must not hide our own figures
        return {"trl_error": trl_peer.describe_error(e)}
    return {"trl_samples_per_s": run.samples_per_s, "trl_threads": threads,
            "trl_versions": trl_peer.versions()}


# ---- main ----------------------------------------------------------------------------------------


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.fmean(r[key] for r in runs)


def _overhead(run: dict[str, Any]) -> float:
    return float(run["overhead_controller"] + run["overhead_node"] + run["overhead_workers"])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    overrides = [*(SMALL_STEPS if args.small_steps else ()), *args.overrides]
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    elif args.quick:
        overrides.append(f"steps={QUICK_STEPS}")
    recipe = load_recipe(RECIPE, overrides)
    from flowrl.run import prepare_model

    model_dir = await asyncio.to_thread(prepare_model, recipe)
    assert model_dir is not None
    sync: list[dict[str, Any]] = []
    async_: list[dict[str, Any]] = []
    for seed in args.seeds:
        seeded = apply_overrides(recipe, [(("seed",), seed)], file=str(RECIPE))
        sync.append(await run_mode(seeded, 0, recipe.steps))
        async_.append(await run_mode(seeded, 1, recipe.steps))
    ws = await weight_sync(model_dir, 20 if args.quick else 100)
    # The recipe's 4 MB of weights copy from cache; a real model's copy from DRAM, where the
    # fixed costs vanish and page faults would dominate without the store's warm pool.
    with tempfile.TemporaryDirectory(prefix="flowrl-e2e-ws-") as tmp:
        from flowrl.tiny_model import build_tiny_model

        hidden = 512 if args.quick else 1024
        big = await asyncio.to_thread(build_tiny_model, Path(tmp) / "model", hidden=hidden,
                                      layers=8, heads=8, kv_heads=4)
        ws_big = await weight_sync(big, 6 if args.quick else 10)
    rate_sync, rate_async = _mean(sync, "samples_per_s"), _mean(async_, "samples_per_s")
    out: dict[str, Any] = {
        "samples_per_s_sync": round(rate_sync, 1),
        "samples_per_s_async": round(rate_async, 1),
        "speedup_async": round(rate_async / rate_sync, 3),
        "reward_first_sync": round(_mean(sync, "reward_first"), 4),
        "reward_first_async": round(_mean(async_, "reward_first"), 4),
        "reward_final_sync": round(_mean(sync, "reward_final"), 4),
        "reward_final_async": round(_mean(async_, "reward_final"), 4),
        "overhead_share": round(statistics.fmean(map(_overhead, async_)), 4),
        "overhead_controller": round(_mean(async_, "overhead_controller"), 4),
        "overhead_node": round(_mean(async_, "overhead_node"), 4),
        "overhead_workers": round(_mean(async_, "overhead_workers"), 4),
        "overhead_share_sync": round(statistics.fmean(map(_overhead, sync)), 4),
        "overhead_cpu_ms_per_sample": round(statistics.fmean(
            1000 * _overhead(r) * r["wall_s"] / r["samples"] for r in async_), 3),
        "weight_sync_gbps": round(ws["weight_sync_gbps"], 3),
        "memcpy_gbps": round(ws["memcpy_gbps"], 3),
        "weight_sync_vs_memcpy": round(ws["weight_sync_gbps"] / ws["memcpy_gbps"], 3),
        "weight_bytes": int(ws["weight_bytes"]),
        "weight_sync_gbps_large": round(ws_big["weight_sync_gbps"], 3),
        "memcpy_gbps_large": round(ws_big["memcpy_gbps"], 3),
        "weight_sync_vs_memcpy_large": round(ws_big["weight_sync_gbps"] / ws_big["memcpy_gbps"], 3),
        "weight_bytes_large": int(ws_big["weight_bytes"]),
        "samples": async_[0]["samples"],
        "steps": recipe.steps,
        "seeds": list(args.seeds),
        "quick": args.quick,
        "job": "small_steps" if args.small_steps else "recipe",
    }
    if len(args.seeds) > 1:
        for key in ("samples_per_s", "reward_final"):
            out[f"{key}_sync_by_seed"] = [round(r[key], 4) for r in sync]
            out[f"{key}_async_by_seed"] = [round(r[key], 4) for r in async_]
    if args.vs_trl:
        trl = await asyncio.to_thread(trl_side_by_side, recipe, model_dir, recipe.steps,
                                      args.trl_threads)
        out.update(trl)
        if "trl_samples_per_s" in trl:
            out["trl_samples_per_s"] = round(trl["trl_samples_per_s"], 1)
            out["ratio_vs_trl"] = round(rate_async / trl["trl_samples_per_s"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps per mode (< 60 s once the model is cached)")
    p.add_argument("--small-steps", action="store_true",
                   help="groups of 4, 16-token completions, 8 completions per step (TRL's scale)")
    p.add_argument("--seeds", type=seed_list, default=[0], metavar="S[,S...]",
                   help="recipe seeds; each runs both modes and the figures are means (default 0)")
    p.add_argument("--steps", type=int, help="steps per mode (default: the recipe's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the recipe, as the launcher's --set")
    p.add_argument("--vs-trl", action="store_true",
                   help="also run TRL's GRPOTrainer on the same job, when trl is importable")
    p.add_argument("--trl-threads", type=int, default=1, metavar="N",
                   help="torch threads of TRL's run (default 1: bench/trl_peer.py says why)")
    args = p.parse_args()
    if args.trl_threads < 1:
        p.error("--trl-threads must be >= 1")
    configure(level="warning")
    run_and_print(main_async(args))


if __name__ == "__main__":
    main()
