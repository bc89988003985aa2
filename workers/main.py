"""Entry point of a worker process: ``python -m workers.main --spec FILE``.

``FILE`` holds the process's `flowrl.worker_spec.WorkerSpec` (written by
`flowrl.worker_launch.worker_command`, mode 0600, removed once read). The process hosts the
spec's ``count`` workers of one role (real engines use one; simulated workers are cheap and
many share a process). It exits when the controller broadcasts ``stop``, on SIGTERM (SIGINT is
left to the controller that started it: `flowrl.lifecycle.stop_signals`), or when its parent
dies (Linux parent-death signal), so a killed controller never leaves orphans behind. A process
whose roles cannot be built (a model, dataset or reward function that fails to load) tells the
controller why (``start_failed``) before it exits with the traceback.
"""

from __future__ import annotations

from flowrl.lifecycle import die_with_parent, run_main, stop_signals

if __name__ == "__main__":
    # First thing: the imports below take seconds (torch), and a parent killed meanwhile must
    # not leave this process behind.
    die_with_parent()

import argparse
import asyncio
import contextlib
import os
from pathlib import Path

import structlog

from flowrl import messages as m
from flowrl.logs import bind, configure
from flowrl.worker_launch import read_spec
from flowrl.worker_spec import EngineSpec, ProcessSpec, WorkerSpec
from transport.errors import TransportError
from transport.process_limits import SocketRoomError, make_room
from transport.rpc import RpcClient
from transport.store_client import StoreClient
from workers.runtime import (
    Role,
    ServedReports,
    WeightFetches,
    WeightSyncError,
    Worker,
    WorkerConfig,
)

log = structlog.get_logger("flowrl.worker")

#: exit code of a worker process that missed its weight-sync deadline.
EXIT_WEIGHT_SYNC = 3


def make_role(process: ProcessSpec, run_id: str, seed: int) -> Role:
    """One worker's role of ``process`` (its engine and settings), seeded with ``seed``."""
    if process.sim is not None:
        from workers.sim import SIM_ROLES
        from workers.sim_cost import SimCost

        try:
            cls = SIM_ROLES[process.role]
        except KeyError:
            raise ValueError(f"no simulated role {process.role!r}; have "
                             f"{sorted(SIM_ROLES)}") from None
        sim_role: Role = cls(SimCost.from_dict(process.sim), seed)
        return sim_role
    assert isinstance(process.config, EngineSpec)  # ProcessSpec: an engine config unless sim
    from workers.roles.factory import make_hf_role, make_vllm_role

    make = make_vllm_role if process.engine == "vllm" else make_hf_role
    return make(process.role, process.config, seed, process=process.name, run_id=run_id)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, required=True, help="the process's spec file")
    return p.parse_args(argv)


def worker_configs(spec: WorkerSpec) -> list[WorkerConfig]:
    """The configurations of the process's ``count`` workers."""
    from transport.curve import CurveKeys

    p, at = spec.process, spec.endpoints
    keys = CurveKeys.from_env()  # the run's keys, when it spans nodes
    # A colocated process's rollout worker comes after its trainer (``<process>.<count>``).
    roles = [(p.role, p.capacity)] * p.count + (
        [] if p.colocated is None else [(p.colocated.role, p.colocated.capacity)])
    return [WorkerConfig(name=f"{p.name}.{i}", role=role, node=at.node,
                         controller=at.controller, broadcast=at.broadcast, capacity=capacity,
                         heartbeat_s=p.heartbeat_s, curve=keys,
                         weight_sync_timeout_s=p.weight_sync_timeout_s, relay=at.relay,
                         tasks=at.tasks if role == p.role else None)
            for i, (role, capacity) in enumerate(roles)]


#: sockets a worker may hold: the controller's endpoint, its node relay's, broadcasts, and its
#: agent's under node dispatch
SOCKETS_PER_WORKER = 4
#: and its process: the store client's, its relay client (the workers' gathered ``served``), a
#: start-failure report's, spares
SOCKETS_PER_PROCESS = 8


def sockets_needed(spec: WorkerSpec) -> int:
    """The most ZeroMQ sockets the process of ``spec`` holds at once."""
    p = spec.process
    workers = p.count + (p.colocated is not None)
    return (SOCKETS_PER_WORKER * workers + SOCKETS_PER_PROCESS
            + len(spec.endpoints.peers))  # a store client per node it reads from


def store_client(spec: WorkerSpec) -> StoreClient:
    """The process's client of its node's store (and, for reads, other nodes')."""
    from transport.curve import CurveKeys

    at = spec.endpoints
    return StoreClient(at.run_id, at.node, at.store, peers=at.peers, curve=CurveKeys.from_env())


def use_threads(spec: WorkerSpec) -> None:
    """Give torch the process's threads (before any role is built)."""
    import torch

    torch.set_num_threads(max(1, spec.process.threads))


def make_roles(spec: WorkerSpec) -> list[Role]:
    """The roles of the process's ``count`` workers, each seeded apart."""
    p = spec.process
    if p.colocated is not None:  # one trainer (or rank) and the rollout engine on its weights
        assert isinstance(p.config, EngineSpec)  # ProcessSpec: colocated only on hf or vllm
        from workers.roles.factory import make_colocated_roles

        # Seeded as the separate processes would be (process i of each pool, worker 0).
        return list(make_colocated_roles(p.config, p.seed * 100, rollout_engine=p.engine,
                                         keep_weight_copy=p.colocated.keep_weight_copy,
                                         process=p.name, run_id=spec.endpoints.run_id))
    return [make_role(p, spec.endpoints.run_id, p.seed * 100 + i) for i in range(p.count)]


def start_failure(spec: WorkerSpec, exc: BaseException) -> dict[str, str]:
    """The ``start_failed`` report of a process whose roles could not be built."""
    return {"process": spec.process.name, "token": spec.process.start_token,
            "error": f"{type(exc).__name__}: {exc}"[:2000]}


async def report_start_failure(spec: WorkerSpec, exc: BaseException) -> None:
    """Tell the controller why this process cannot start (it has not registered yet); a
    controller that cannot be reached learns it from the exit."""
    from transport.curve import CurveKeys, for_endpoint

    at = spec.endpoints
    rpc = RpcClient(at.controller, timeout=10.0,
                    curve=for_endpoint(CurveKeys.from_env(), at.controller))
    try:
        with contextlib.suppress(TransportError):
            await rpc.call(m.OP_START_FAILED, start_failure(spec, exc))
    finally:
        await rpc.aclose()


async def serve(spec: WorkerSpec) -> None:
    try:  # before any socket: ZeroMQ takes the count when its context starts
        make_room(sockets_needed(spec), what=f"worker process {spec.process.name} "
                                             f"({spec.process.count} workers)")
    except SocketRoomError as exc:
        await report_start_failure(spec, exc)
        raise
    store = store_client(spec)
    roles: list[Role] = []
    # The process's one client of its node's relay, for its workers' gathered ``served``.
    relay: RpcClient | None = None
    served: ServedReports | None = None
    try:
        try:
            roles = make_roles(spec)
        except Exception as exc:
            await report_start_failure(spec, exc)
            raise
        configs = worker_configs(spec)
        weights = WeightFetches(store, len(roles))
        if spec.endpoints.relay:
            relay = RpcClient(spec.endpoints.relay, timeout=configs[0].rpc_timeout_s)
            served = ServedReports(relay)
        workers = [Worker(config, role, store, weights, served) for config, role in
                   zip(configs, roles, strict=True)]

        def stop_all() -> None:
            for w in workers:
                w.stop()

        loop = asyncio.get_running_loop()
        for sig in stop_signals():
            loop.add_signal_handler(sig, stop_all)
        async with asyncio.TaskGroup() as tg:
            for w in workers:
                tg.create_task(w.run())
    except* WeightSyncError:
        # The load may still be running in a thread that interpreter shutdown would wait for;
        # the controller has been told (sync_failed) and restarts this process.
        os._exit(EXIT_WEIGHT_SYNC)
    finally:
        for role in roles:  # what a role started (tool sandboxes) stops with it
            close = getattr(role, "aclose", None)
            if close is not None:
                await close()
        if relay is not None:
            await relay.aclose()
        await store.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    die_with_parent()  # (again, when called other than as ``python -m workers.main``)
    configure()
    spec = read_spec(args.spec)
    bind(run_id=spec.endpoints.run_id, role=spec.process.role, process=spec.process.name)
    use_threads(spec)
    run_main(serve(spec))


if __name__ == "__main__":
    main()
