"""Entry point of a worker process: ``python -m workers.main --role rollout ...``.

Hosts ``--count`` workers of one role in this process (real engines use one; simulated
workers are cheap and many share a process). The process exits when the controller broadcasts
``stop``, on SIGTERM/SIGINT, or when its parent dies (Linux parent-death signal), so a killed
controller never leaves orphans behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from typing import Any

import structlog

from flowrl.lifecycle import die_with_parent, run_main
from flowrl.logs import bind, configure
from workers.runtime import Role, WeightSyncError, Worker, WorkerConfig

log = structlog.get_logger("flowrl.worker")

#: exit code of a worker process that missed its weight-sync deadline.
EXIT_WEIGHT_SYNC = 3

def make_role(engine: str, role: str, config: dict[str, Any], seed: int) -> Role:
    if engine == "sim":
        from workers.sim import SIM_ROLES, SimCost

        try:
            cls = SIM_ROLES[role]
        except KeyError:
            raise ValueError(f"no simulated role {role!r}; have {sorted(SIM_ROLES)}") from None
        sim_role: Role = cls(SimCost.from_dict(config), seed)
        return sim_role
    if engine == "hf":
        from workers.roles.factory import make_hf_role

        return make_hf_role(role, config, seed)
    if engine == "vllm":
        from workers.roles.factory import make_vllm_role

        return make_vllm_role(role, config, seed)
    raise ValueError(f"unknown engine {engine!r}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.main", description=__doc__)
    p.add_argument("--run-id", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--controller", required=True)
    p.add_argument("--broadcast", required=True)
    p.add_argument("--store", required=True, help="this node's store server endpoint")
    p.add_argument("--peers", default="{}", help="JSON: other nodes' store endpoints by node")
    p.add_argument("--role", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--capacity", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engine", default="sim")
    p.add_argument("--engine-config", default="{}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--weight-sync-timeout", type=float, default=60.0)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    from transport.curve import CurveKeys
    from transport.endpoints import run_dir
    from transport.store_server import StoreClient
    from workers.distributed import for_process

    config = for_process(json.loads(args.engine_config), role=args.role, name=args.name,
                         run_dir=run_dir(args.run_id))
    if args.engine != "sim":  # a simulation's config is its cost model, nothing else
        config["run_id"] = args.run_id  # e.g. a restarted critic finds its own run's last save
    keys = CurveKeys.from_env()  # the run's keys, when it spans nodes
    store = StoreClient(args.run_id, args.node, args.store, peers=json.loads(args.peers),
                        curve=keys)
    workers = [
        Worker(
            WorkerConfig(name=f"{args.name}.{i}", role=args.role, node=args.node,
                         controller=args.controller, broadcast=args.broadcast,
                         capacity=args.capacity, heartbeat_s=args.heartbeat, curve=keys,
                         weight_sync_timeout_s=args.weight_sync_timeout),
            make_role(args.engine, args.role, config, args.seed * 100 + i),
            store,
        )
        for i in range(args.count)
    ]
    def stop_all() -> None:
        for w in workers:
            w.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        async with asyncio.TaskGroup() as tg:
            for w in workers:
                tg.create_task(w.run())
    except* WeightSyncError:
        # The load may still be running in a thread that interpreter shutdown would wait for;
        # the controller has been told (sync_failed) and restarts this process.
        os._exit(EXIT_WEIGHT_SYNC)
    finally:
        await store.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    die_with_parent()
    configure()
    bind(run_id=args.run_id, role=args.role, process=args.name)
    import torch

    torch.set_num_threads(max(1, args.threads))
    run_main(serve(args))


if __name__ == "__main__":
    main()
