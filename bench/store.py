"""Sample store throughput and RPC latency. Prints one JSON line.

Workload: micro-batches of 64 rows with fields prompt_ids int64[512], response_ids int64[1024]
and logprobs float32[1024] (1 MiB per micro-batch). Figures are measured in rounds of 16
micro-batches and each is the best round (the machine is shared: the best round is the one
least disturbed), all in this run, so ratios between them are meaningful:

- ``memcpy_gbps``: copying each field of a micro-batch into a new tensor (the one copy
  `get_padded` must make), private memory to private memory, sources larger than the caches,
  in the reader process, in rounds interleaved with its local reads (below).
- ``put_gbps``: `SampleStore.put` in the store's process, steady state (each round's segments
  are freed before the next, so the pool is warm); ``put_fresh_gbps``: the pool off (fresh
  shared memory every put); ``client_put_gbps``: `StoreClient.put` from a worker process
  (writes shared memory itself; one commit round trip per put, the next put's capacity granted
  with the commit); ``client_put_reserve_each_gbps``: the same reserving capacity with its own
  round trip before every put.
- ``local_get_gbps``: `StoreClient.get_padded` of every field from another process on the
  node, steady state (the writer puts a round, the reader reads it, the round is freed);
  ``local_get_cold_gbps``: the first round (segments this reader never mapped before);
  ``local_get_many_gbps``: `StoreClient.get_padded_many` of each micro-batch's fields in one
  call. The reader decodes the handles it receives with `rows_from_wire` (into `Rows`, whose
  layout is checked once) before timing; ``local_get_lists_gbps``: `get_padded` of handles
  decoded row by row with `Handle.from_wire` (plain lists, checked on every read). These
  three and `memcpy_gbps` take turns round by round. ``decode_rows_us`` /
  ``decode_each_us``: what the two decodings cost per field of 64 rows.
  ``local_get_*_vs_memcpy``: each against `memcpy_gbps`.
- ``remote_get_gbps``: the same from a process configured as another node, through the store
  server over loopback TCP, 2 micro-batches in flight; ``zmq_tcp_gbps``: raw ZeroMQ frames of
  the same sizes over loopback TCP with as many requests in flight (the transport's ceiling).
- ``rpc_rtt_us_p50`` / ``rpc_rtt_us_p99``: `RpcClient.call` round trips to an `RpcServer` in
  another process over ipc, uvloop on both sides.
- with ``--vs-transferqueue`` and `transfer_queue` importable: ``tq_put_gbps``,
  ``tq_get_gbps`` (TransferQueue's client `put`, and `get_meta` + `get_data`, of the same
  micro-batches, after ours, in this process) and the ratios of ours to theirs
  (``ratio_put_vs_tq``: `put_gbps`; ``ratio_client_put_vs_tq``: `client_put_gbps`;
  ``ratio_get_vs_tq``: `local_get_gbps`).

    python bench/store.py [--quick] [--vs-transferqueue]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import uvloop
import zmq
import zmq.asyncio

from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir, tcp_endpoint
from transport.handles import rows_from_wire
from transport.rpc import RpcClient, RpcServer
from transport.store import Handle, SampleStore
from transport.store_client import StoreClient
from transport.store_server import StoreServer

ROWS = 64
FIELDS = {
    "prompt_ids": (torch.int64, 512),
    "response_ids": (torch.int64, 1024),
    "logprobs": (torch.float32, 1024),
}
BATCH_BYTES = sum(
    ROWS * width * torch.empty((), dtype=dt).element_size() for dt, width in FIELDS.values()
)
IN_FLIGHT = 2  # micro-batches a remote reader keeps requested at once (3 fields each)
ROUND = 16  # micro-batches per measured round

Batch = dict[str, tuple[torch.Tensor, torch.Tensor]]


def make_batches(count: int, seed: int = 0) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        batch: Batch = {}
        for name, (dtype, width) in FIELDS.items():
            if dtype.is_floating_point:
                values = torch.randn(ROWS, width, generator=g).to(dtype)
            else:
                values = torch.randint(0, 50_000, (ROWS, width), generator=g, dtype=dtype)
            batch[name] = (values, torch.full((ROWS,), width))
        out.append(batch)
    return out


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


# ---------------------------------------------------------------------------------------------
# In the store's process


async def bench_put(store: SampleStore, batches: list[Batch], rounds: int) -> float:
    """Steady state: put a round, free it, put the next (the first round only warms up)."""
    best = 0.0
    for r in range(rounds + 1):
        start = time.perf_counter()
        written = [await store.put(batches[(r * ROUND + i) % len(batches)]) for i in range(ROUND)]
        if r:
            best = max(best, gbps(ROUND * BATCH_BYTES, time.perf_counter() - start))
        for handles in written:
            store.free([h for hs in handles.values() for h in hs])
    return best


async def serve_raw_zmq(sock: zmq.asyncio.Socket, frames: dict[bytes, memoryview]) -> None:
    """Answer each request (field name) with that field's bytes: one zero-copy frame."""
    while True:
        ident, name = await sock.recv_multipart()
        await sock.send_multipart([ident, frames[name]], copy=False)


async def echo(payload: Any, peer: bytes) -> Any:
    return payload


# ---------------------------------------------------------------------------------------------
# In the reader process


async def timed_reads(
    batches: list[dict[str, Sequence[Handle]]],
    read: Callable[[Sequence[Handle]], Awaitable[tuple[torch.Tensor, torch.Tensor]]],
    in_flight: int,
) -> float:
    """Seconds to read every field of every micro-batch into batch tensors, `in_flight`
    micro-batches at a time (1: one field after the other, as a local reader does)."""
    start = time.perf_counter()
    if in_flight == 1:
        for handles in batches:
            for hs in handles.values():
                await read(hs)
    else:
        sem = asyncio.Semaphore(in_flight)  # bounds reads in flight, like a trainer's prefetch

        async def one(handles: dict[str, Sequence[Handle]]) -> None:
            async with sem:
                await asyncio.gather(*(read(hs) for hs in handles.values()))

        await asyncio.gather(*(one(b) for b in batches))
    return time.perf_counter() - start


async def timed_reads_many(
    batches: list[dict[str, Sequence[Handle]]], client: StoreClient
) -> float:
    """Seconds to read every micro-batch with one `get_padded_many` call each."""
    start = time.perf_counter()
    for handles in batches:
        await client.get_padded_many(handles)
    return time.perf_counter() - start


async def timed_raw_zmq(endpoint: str, rounds: int) -> float:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    names = [n.encode() for n in FIELDS]
    window = IN_FLIGHT * len(names)
    best = 0.0
    try:
        for name in names:  # warm up the connection
            await sock.send_multipart([name])
            await sock.recv_multipart(copy=False)
        for _ in range(rounds):
            start = time.perf_counter()
            requests = [names[i % len(names)] for i in range(ROUND * len(names))]
            sent = received = 0
            while received < len(requests):
                while sent < len(requests) and sent - received < window:
                    await sock.send_multipart([requests[sent]])
                    sent += 1
                await sock.recv_multipart(copy=False)
                received += 1
            best = max(best, gbps(ROUND * BATCH_BYTES, time.perf_counter() - start))
        return best
    finally:
        sock.close(linger=0)
        ctx.term()


async def timed_client_put(client: StoreClient, batches: list[Batch], rounds: int) -> float:
    best = 0.0
    for r in range(rounds + 1):
        start = time.perf_counter()
        written = [await client.put(batches[(r * ROUND + i) % len(batches)]) for i in range(ROUND)]
        if r:
            best = max(best, gbps(ROUND * BATCH_BYTES, time.perf_counter() - start))
        await client.free([h for b in written for hs in b.values() for h in hs])
    return best


async def timed_rtt(endpoint: str, calls: int) -> tuple[float, float]:
    async with RpcClient(endpoint) as client:
        for _ in range(100):
            await client.call("echo", {"n": 0})
        samples = []
        for i in range(calls):
            start = time.perf_counter()
            await client.call("echo", {"n": i})
            samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return round(samples[len(samples) // 2], 1), round(samples[int(len(samples) * 0.99)], 1)


def timed_memcpy(batches: list[Batch], r: int) -> float:
    """Seconds to copy every field of ROUND micro-batches into new tensors (round `r`)."""
    start = time.perf_counter()
    for i in range(ROUND):
        for values, _ in batches[(r * ROUND + i) % len(batches)].values():
            torch.empty_like(values).copy_(values)
    return time.perf_counter() - start


def decode_each(wire: list[Any]) -> Sequence[Handle]:
    return [Handle.from_wire(h) for h in wire]


async def reader(config: dict[str, Any]) -> None:
    """Serve the parent's commands, one JSON line each, answering one JSON line each."""
    run_id = config["run_id"]
    local = StoreClient(run_id, "node0", config["store_ipc"])
    remote = StoreClient(run_id, "node1", "ipc:///unused", peers={"node0": config["store_tcp"]})
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader(limit=1 << 26)  # a command carries a window of handles
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    copies: list[Batch] = []  # memcpy sources, made on first use: 64 MiB, beyond the caches
    async with local, remote:
        while line := await stdin.readline():
            cmd = json.loads(line)
            op = cmd["op"]
            reply: Any
            if op == "memcpy":
                copies = copies or make_batches(64, seed=2)
                reply = timed_memcpy(copies, cmd["round"])
            elif op == "get":
                decode = rows_from_wire if cmd["rows"] else decode_each
                batches = [{k: decode(hs) for k, hs in b.items()} for b in cmd["batches"]]
                client = local if cmd["node"] == "node0" else remote
                if cmd["many"]:
                    reply = await timed_reads_many(batches, client)
                else:
                    reply = await timed_reads(batches, client.get_padded, cmd["in_flight"])
            elif op == "client_put":
                sources = make_batches(16, seed=1)
                if cmd["spare"]:
                    reply = await timed_client_put(local, sources, cmd["rounds"])
                else:
                    each = StoreClient(run_id, "node0", config["store_ipc"], spare=False)
                    async with each:
                        reply = await timed_client_put(each, sources, cmd["rounds"])
            elif op == "zmq":
                reply = await timed_raw_zmq(config["raw_tcp"], cmd["rounds"])
            elif op == "rtt":
                reply = await timed_rtt(config["rpc_ipc"], cmd["calls"])
            else:
                raise ValueError(f"unknown command {op!r}")
            print(json.dumps(reply), flush=True)


# ---------------------------------------------------------------------------------------------
# Orchestration


class Reader:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ask(self, cmd: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"reader process exited with {await self.proc.wait()}")
        return json.loads(line)


class ReadMode(NamedTuple):
    memcpy: bool = False  # the baseline instead: copy as many bytes, private memory to private
    many: bool = False  # one get_padded_many per micro-batch, else one get_padded per field
    rows: bool = True  # handles decoded with rows_from_wire, else Handle.from_wire row by row


async def steady_reads(
    store: SampleStore,
    reader: Reader,
    sources: list[Batch],
    node: str,
    rounds: int,
    modes: Sequence[ReadMode] = (ReadMode(),),
) -> tuple[float, list[float]]:
    """(first round, best later round per mode) GB/s: each round puts ROUND micro-batches, the
    reader reads every field once, then they are freed, so later rounds reuse pooled segments
    as a running pipeline does. `modes` take turns, round by round, so that each sees the same
    conditions (the machine is shared: a baseline measured at another time is not one)."""
    first = 0.0
    best = [0.0] * len(modes)
    for r in range(rounds * len(modes) + 1):
        written = [await store.put(sources[(r * ROUND + i) % len(sources)]) for i in range(ROUND)]
        wire = [{k: [list(h) for h in hs] for k, hs in b.items()} for b in written]
        in_flight = 1 if node == "node0" else IN_FLIGHT
        mode = (r - 1) % len(modes) if r else 0
        if modes[mode].memcpy:
            seconds = await reader.ask({"op": "memcpy", "round": r})
        else:
            seconds = await reader.ask(
                {
                    "op": "get",
                    "node": node,
                    "batches": wire,
                    "in_flight": in_flight,
                    **modes[mode]._asdict(),
                }
            )
        if r == 0:
            first = gbps(ROUND * BATCH_BYTES, seconds)
        else:
            best[mode] = max(best[mode], gbps(ROUND * BATCH_BYTES, seconds))
        for handles in written:
            store.free([h for hs in handles.values() for h in hs])
    return first, best


def bench_decode(store_handles: dict[str, list[Handle]], repeat: int) -> tuple[float, float]:
    """µs to decode one field's handles (64 rows, as received in a JSON or msgpack message):
    `rows_from_wire`, and `Handle.from_wire` row by row."""
    wire = [json.loads(json.dumps(hs)) for hs in store_handles.values()]
    best_rows = best_each = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for hs in wire:
            rows_from_wire(hs)
        best_rows = min(best_rows, (time.perf_counter() - start) / len(wire))
        start = time.perf_counter()
        for hs in wire:
            [Handle.from_wire(h) for h in hs]
        best_each = min(best_each, (time.perf_counter() - start) / len(wire))
    return round(best_rows * 1e6, 1), round(best_each * 1e6, 1)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    rounds = 8 if quick else 30
    run_id = new_run_id()
    result: dict[str, Any] = {"memcpy_gbps": 0.0}  # measured with the local reads, below

    sources = make_batches(64)  # 64 MiB: larger than the caches

    capacity = 1 << 30
    with SampleStore(run_id, "node0", capacity_bytes=capacity, pool_bytes=0) as fresh:
        result["put_fresh_gbps"] = await bench_put(fresh, sources, rounds)
    store = SampleStore(run_id, "node0", capacity_bytes=capacity)
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.ROUTER)
    try:
        result["put_gbps"] = await bench_put(store, sources, rounds)
        one = await store.put(sources[0])
        result["decode_rows_us"], result["decode_each_us"] = bench_decode(one, 200)
        store.free([h for hs in one.values() for h in hs])
        raw.bind(tcp_endpoint())
        raw_endpoint = raw.getsockopt_string(zmq.LAST_ENDPOINT)
        raw_frames = {
            name.encode(): values.reshape(-1).view(torch.uint8).numpy().data
            for name, (values, _) in sources[0].items()
        }
        async with (
            StoreServer(store, ipc_endpoint(run_id, "store"), ctx=ctx) as store_ipc,
            StoreServer(store, tcp_endpoint(), ctx=ctx) as store_tcp,
            RpcServer(ipc_endpoint(run_id, "echo"), {"echo": echo}, ctx=ctx) as rpc,
            asyncio.TaskGroup() as tg,
        ):
            raw_task = tg.create_task(serve_raw_zmq(raw, raw_frames))
            config = {
                "run_id": run_id,
                "store_ipc": store_ipc.endpoint,
                "store_tcp": store_tcp.endpoint,
                "raw_tcp": raw_endpoint,
                "rpc_ipc": rpc.endpoint,
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--reader",
                json.dumps(config),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                reader_proc = Reader(proc)
                modes = [
                    ReadMode(),
                    ReadMode(memcpy=True),
                    ReadMode(many=True),
                    ReadMode(rows=False),
                ]
                cold, (single, memcpy, many, lists) = await steady_reads(
                    store, reader_proc, sources, "node0", rounds, modes
                )
                result["memcpy_gbps"] = memcpy
                result["local_get_cold_gbps"] = cold
                result["local_get_gbps"], result["local_get_many_gbps"] = single, many
                result["local_get_lists_gbps"] = lists
                _, (result["remote_get_gbps"],) = await steady_reads(
                    store, reader_proc, sources, "node1", rounds
                )
                result["zmq_tcp_gbps"] = await reader_proc.ask({"op": "zmq", "rounds": rounds})
                result["client_put_gbps"] = await reader_proc.ask(
                    {"op": "client_put", "rounds": rounds, "spare": True}
                )
                result["client_put_reserve_each_gbps"] = await reader_proc.ask(
                    {"op": "client_put", "rounds": rounds, "spare": False}
                )
                p50, p99 = await reader_proc.ask({"op": "rtt", "calls": 2000 if quick else 10000})
                result["rpc_rtt_us_p50"], result["rpc_rtt_us_p99"] = p50, p99
            finally:
                assert proc.stdin is not None
                proc.stdin.close()
                if await proc.wait() != 0:
                    raise RuntimeError(f"reader process failed with {proc.returncode}")
                raw_task.cancel()
    finally:
        raw.close(linger=0)
        ctx.term()
        store.close()
        remove_run_dir(run_id)

    memcpy = result["memcpy_gbps"]
    result["local_get_vs_memcpy"] = round(result["local_get_gbps"] / memcpy, 3)
    result["local_get_many_vs_memcpy"] = round(result["local_get_many_gbps"] / memcpy, 3)
    result["local_get_lists_vs_memcpy"] = round(result["local_get_lists_gbps"] / memcpy, 3)
    result["remote_get_vs_zmq"] = round(result["remote_get_gbps"] / result["zmq_tcp_gbps"], 3)
    return result


def bench_transferqueue(batches: list[Batch], rounds: int) -> dict[str, Any]:
    """TransferQueue on the same workload through its client, in this process: per round, `put`
    every micro-batch into a fresh partition, then `get_meta` + `get_data` each back (64 rows,
    every field), then `clear_partition`. Its data goes through its storage actors (other
    processes) both ways. Skipped unless `transfer_queue` imports; any failure is reported in
    the JSON instead of the figures. Starts Ray here and shuts it down (with every process it
    started) before returning, and removes the directory Ray wrote its sessions to."""
    try:
        import ray  # type: ignore[import-not-found, unused-ignore]
        import transfer_queue as tq  # type: ignore[import-not-found, unused-ignore]
        from tensordict import TensorDict  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return {"tq_skipped": "transfer_queue is not importable (see bench/README.md)"}
    started = not ray.is_initialized()
    ray_dir = tempfile.mkdtemp(prefix="ray-tq-bench-")  # Ray's sessions and logs, removed after
    try:
        if started:
            # The controller and its two storage units ask for one CPU each.
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
        # polling_mode: get_meta answers at once when too few rows are ready (default: sleeps).
        tq.init({"controller": {"polling_mode": True}})
        try:
            return _tq_rounds(tq.get_client(), TensorDict, batches, rounds)
        finally:
            tq.close()
    except Exception as exc:  # an optional peer: report, do not fail the whole benchmark
        return {"tq_error": f"{type(exc).__name__}: {exc}"}
    finally:
        if started and ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)


def _tq_rounds(client: Any, tensordict: Any, batches: list[Batch], rounds: int) -> dict[str, Any]:
    fields = list(FIELDS)
    best_put = best_get = 0.0
    for r in range(rounds + 1):
        data = [tensordict({k: v for k, (v, _) in b.items()}, batch_size=ROWS) for b in batches]
        part = f"round{r}"
        start = time.perf_counter()
        for td in data:
            client.put(data=td, partition_id=part)
        put_s = time.perf_counter() - start
        got = []
        start = time.perf_counter()
        for _ in data:
            meta = client.get_meta(
                data_fields=fields, batch_size=ROWS, partition_id=part, task_name="bench"
            )
            if meta.size != ROWS:
                raise RuntimeError(f"get_meta returned {meta.size} rows, {ROWS} were put")
            got.append(client.get_data(meta))
        get_s = time.perf_counter() - start
        if r == 0:  # the first round warms up, and checks what comes back
            for td, batch in zip(got, batches, strict=True):
                for name, (values, _) in batch.items():
                    field = td[name]
                    rows = torch.stack(field.unbind()) if field.is_nested else field
                    if not torch.equal(rows, values):
                        raise RuntimeError(f"TransferQueue returned other {name} than was put")
        client.clear_partition(part)
        if r:
            nbytes = len(data) * BATCH_BYTES
            best_put = max(best_put, gbps(nbytes, put_s))
            best_get = max(best_get, gbps(nbytes, get_s))
    return {"tq_put_gbps": best_put, "tq_get_gbps": best_get}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer passes: under a minute")
    p.add_argument("--vs-transferqueue", action="store_true", help="also measure TransferQueue")
    p.add_argument("--reader", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)  # one core per process, as the node agent and workers run
    if args.reader:
        uvloop.run(reader(json.loads(args.reader)))
        return
    result = uvloop.run(main_async(args))
    if args.vs_transferqueue:  # after ours, outside any event loop: its client runs its own
        result.update(bench_transferqueue(make_batches(ROUND), 2 if args.quick else 5))
        if "tq_put_gbps" in result:
            tq_put = result["tq_put_gbps"]
            result["ratio_put_vs_tq"] = round(result["put_gbps"] / tq_put, 1)
            result["ratio_client_put_vs_tq"] = round(result["client_put_gbps"] / tq_put, 1)
            result["ratio_get_vs_tq"] = round(result["local_get_gbps"] / result["tq_get_gbps"], 1)
    result["quick"] = args.quick
    result["machine"] = f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
