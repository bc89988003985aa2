"""Scale-out benchmark: simulated workers across 1, 2 and 4 node agents, and cross-node reads.

Throughput (``samples_per_s_1n``, ``_2n``, ``_4n``): the same simulated GRPO workload with 1,
2 and 4 node agents on this machine (separate processes, each its own node name, store and
tcp+curve store server). Every agent runs the same rollout process (8 simulated workers), so
ideal scaling is linear in the agents; the controller's node runs the reward and train workers,
which read every rollout output from the agents' stores across nodes (tcp+curve). Simulated
costs are sleeps, not CPU burn: the machine has 2 cores, and a CPU-bound simulation would
measure the cores, not the system. ``scaling_4n`` = samples_per_s_4n / samples_per_s_1n.

Transport (``cross_node_get_gbps``): a `StoreClient` configured as another node reads 16 MiB
tensors from a `StoreServer` over tcp+curve (loopback), two reads in flight;
``cross_node_get_plaintext_gbps``: the same with the plaintext data plane (the server's second
endpoint: sample bytes unencrypted, each request HMAC-authenticated);
``zmq_tcp_gbps``: raw ZeroMQ frames of the same sizes over plain loopback tcp, two in flight;
``zmq_tcp_curve_gbps``: the same with curve on (the encryption's own cost). Both sides of
these run in this process (one event loop; zmq's I/O threads do the socket work). The four
are measured in turns (``TURNS`` rounds of each, interleaved) and each figure is its best
turn: on a shared machine the best is the least disturbed, and taking turns exposes all four
to the same disturbances, so their ratios mean something.

    python bench/scale.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import zmq
import zmq.asyncio

from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from transport.curve import CurveKeys
from transport.endpoints import new_run_id, remove_run_dir, tcp_endpoint
from transport.store import SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer

ROOT = Path(__file__).resolve().parents[1]
# A group of 4 responses of 64 tokens decodes in 0.1 + 64 * 0.001 s (a sleep); training and
# reward cost next to nothing, so rollout capacity (8 workers per node) sets the throughput.
COST = {
    "prompt_len": 16, "max_new_tokens": 64, "log_mean": 4.16, "log_sigma": 0.0,
    "rollout_base_s": 0.1, "rollout_token_s": 0.001, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.0, "train_step_s": 0.002,
    "weight_numel": 1024,
}
PER_NODE = 8


def workload(nodes: tuple[str, ...]) -> PipelineSpec:
    k = len(nodes)
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=4, reward_micro_batch=16),
        pools=(PoolSpec("rollout", count=PER_NODE * k, per_process=PER_NODE, nodes=nodes),
               PoolSpec("reward", count=2, per_process=2, capacity=2),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=32, max_staleness=2, engine="sim",
        engine_config=COST, store_capacity_bytes=64 << 20, heartbeat_s=1.0,
        heartbeat_timeout_s=30.0,
    )


@contextlib.asynccontextmanager
async def started_with_agents(spec: PipelineSpec, nodes: tuple[str, ...],
                              **kwargs: Any) -> AsyncIterator[Controller]:
    """A started controller for ``spec`` whose other ``nodes`` each get an agent process on
    this machine (``python -m flowrl.node``, tcp+curve); closes both."""
    keys = CurveKeys.generate()
    ctl = Controller(spec, cluster=ClusterConfig(keys=keys), start_timeout_s=180, **kwargs)
    agents: list[asyncio.subprocess.Process] = []
    try:
        starting = asyncio.ensure_future(ctl.start())
        if ctl.nodes is not None:
            endpoint = await ctl.nodes.wait_listening()
            for node in nodes:
                if node == ctl.node:
                    continue
                agents.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "flowrl.node", "--controller", endpoint,
                    "--node", node, stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    cwd=ROOT,
                    env={**os.environ, **keys.to_env(), "FLOWRL_LOG_LEVEL": "warning"}))
        await starting
        yield ctl
    finally:
        await ctl.aclose()
        for a in agents:
            try:
                async with asyncio.timeout(30):
                    await a.wait()
            except TimeoutError:
                a.kill()
                await a.wait()


async def throughput(k: int, steps: int) -> float:
    nodes = tuple(f"n{i}" for i in range(k))
    async with started_with_agents(workload(nodes), nodes) as ctl:
        await ctl.run(steps=1, timeout_s=120)  # warm-up: every worker busy, first version
        out = await ctl.run(steps=steps, timeout_s=300)
    return float(out["samples_per_s"])


# ---------------------------------------------------------------------------------------------
# Transport

READ_BYTES = 16 << 20
IN_FLIGHT = 2
TURNS = 3


async def cross_node_get(rounds: int, *, plaintext: bool = False) -> float:
    run_id = new_run_id()
    keys = CurveKeys.generate()
    store = SampleStore(run_id, "n0", capacity_bytes=256 << 20)
    try:
        rows = [torch.randn(READ_BYTES // 4 // 4) for _ in range(4)]  # one 16 MiB field
        handles = (await store.put({"x": rows}))["x"]
        async with (
            StoreServer(store, tcp_endpoint(), curve=keys, plaintext=plaintext) as server,
            StoreClient(run_id, "n1", "ipc:///unused", peers={"n0": server.endpoint},
                        curve=keys) as reader,
        ):
            await reader.get_padded(handles)  # connect, handshake, warm
            start = time.perf_counter()
            for _ in range(rounds // IN_FLIGHT):
                await asyncio.gather(*(reader.get_padded(handles) for _ in range(IN_FLIGHT)))
            wall = time.perf_counter() - start
    finally:
        store.close()
        remove_run_dir(run_id)
    return (rounds // IN_FLIGHT) * IN_FLIGHT * READ_BYTES / wall / 1e9


async def raw_zmq(rounds: int, keys: CurveKeys | None) -> float:
    ctx = zmq.asyncio.Context()
    server = ctx.socket(zmq.ROUTER)
    client = ctx.socket(zmq.DEALER)
    if keys is not None:
        # A plain context has no ZAP handler: libzmq accepts any curve client, which costs the
        # same handshake and encryption as a checked one.
        for option, value in keys.server_options()[:2]:
            server.setsockopt(option, value)
        for option, value in keys.client_options():
            client.setsockopt(option, value)
    payload = torch.randn(READ_BYTES // 4).view(torch.uint8).numpy().data
    try:
        server.bind(tcp_endpoint())
        client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))

        async def serve() -> None:
            while True:
                peer, _ = await server.recv_multipart()
                await server.send_multipart([peer, payload], copy=False)

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(serve())
            await client.send(b"?")
            await client.recv(copy=False)  # warm
            start = time.perf_counter()
            for _ in range(rounds // IN_FLIGHT):
                for _ in range(IN_FLIGHT):
                    await client.send(b"?")
                for _ in range(IN_FLIGHT):
                    await client.recv(copy=False)
            wall = time.perf_counter() - start
            task.cancel()
    finally:
        server.close(linger=0)
        client.close(linger=0)
        ctx.term()
    return (rounds // IN_FLIGHT) * IN_FLIGHT * READ_BYTES / wall / 1e9


async def main(quick: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    rounds = 16 if quick else 48
    best: dict[str, float] = {}
    measures: dict[str, Callable[[], Awaitable[float]]] = {
        "cross_node_get_gbps": functools.partial(cross_node_get, rounds),
        "cross_node_get_plaintext_gbps": functools.partial(cross_node_get, rounds,
                                                           plaintext=True),
        "zmq_tcp_gbps": functools.partial(raw_zmq, rounds, None),
        "zmq_tcp_curve_gbps": functools.partial(raw_zmq, rounds, CurveKeys.generate()),
    }
    for _ in range(TURNS):
        for key, measure in measures.items():
            best[key] = max(best.get(key, 0.0), await measure())
    result.update({key: round(value, 3) for key, value in best.items()})
    result["cross_node_get_vs_zmq"] = round(
        result["cross_node_get_gbps"] / result["zmq_tcp_gbps"], 3)
    result["cross_node_get_plaintext_vs_zmq"] = round(
        result["cross_node_get_plaintext_gbps"] / result["zmq_tcp_gbps"], 3)
    steps = 3 if quick else 10
    for k in (1, 2, 4):
        result[f"samples_per_s_{k}n"] = round(await throughput(k, steps), 1)
    result["scaling_4n"] = round(result["samples_per_s_4n"] / result["samples_per_s_1n"], 2)
    result["ideal_samples_per_s_1n"] = round(4 * PER_NODE / (0.1 + 64 * 0.001), 1)
    result["quick"] = quick
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (< 60 s)")
    args = parser.parse_args()
    configure(level="warning")
    print(json.dumps(asyncio.run(main(args.quick))))
