"""Long polls held by a parked `transport.rpc.Parked` against a task awaiting a queue each.

The controller's workers wait for tasks in long polls. A poll with nothing to answer used to be
a coroutine in a task of its own, awaiting the worker's queue under `asyncio.timeout`; now it
is parked in the worker's mailbox (`flowrl.control.worker_api`). This measures the two on the
same real `RpcServer`, in one run, with ``--workers`` clients (each its own DEALER socket, all
coroutines of one other process) that poll again as soon as they get a task:

- a round waits until every client's poll is open, then hands each a task in one pass (the
  controller's hand-out of a step's rollout tasks), and waits for every poll to be open again;
- ``cpu_us_per_poll``: the CPU time of this process's event-loop thread over the rounds ÷ polls
  (decoding the request, the handler, holding the poll, the reply);
- ``pass_us_per_task``: the pass's own CPU time ÷ tasks (what a dispatch pass pays a task to
  reach its worker's poll);
- the modes alternate by blocks of rounds, so both see the same load; medians over blocks.

    python bench/long_polls.py [--workers 256] [--rounds 20] [--blocks 6]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.runner import run_and_print
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir
from transport.rpc import Parked, RpcClient, RpcServer

#: what a task carries here: about a rollout task of 4 groups of 4 (16 rows)
TASK = {"stage": "rollout", "rows": list(range(16)), "groups": [0, 1, 2, 3],
        "row_groups": [g for g in range(4) for _ in range(4)], "inputs": {"prompt": [7] * 16},
        "params": {}}
WAIT_S = 60.0
MODES = ("task", "parked")
SCRIPT = str(Path(__file__).resolve())
#: the clients are one process's sockets: ZeroMQ's default context holds up to 1,023
MAX_WORKERS = 512


class Server:
    """One ``poll`` op served either way (``mode``), and the rounds that hand tasks out."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.mode = MODES[0]
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.parked: dict[int, deque[Parked]] = {}
        self.open = 0
        self.all_open = asyncio.Event()
        self.stopping = False

    def poll(self, p: Any, peer: bytes) -> Any:
        if self.stopping:
            return "stop"
        wid = p["id"]
        self._opened()
        if self.mode == "parked":
            poll = Parked(WAIT_S)
            self.parked.setdefault(wid, deque()).append(poll)
            return poll
        q = self.queues.setdefault(wid, asyncio.Queue())
        return self._wait(q)

    async def _wait(self, q: asyncio.Queue[Any]) -> Any:
        # The shape the worker API had: the poll's own task, a timeout, a queue's future.
        try:
            async with asyncio.timeout(WAIT_S):
                return await q.get()
        except TimeoutError:
            return None

    def _opened(self) -> None:
        self.open += 1
        if self.open == self.workers:
            self.all_open.set()

    def hand_out(self) -> None:
        """One task to every open poll, in one pass."""
        self.open = 0
        self.all_open.clear()
        for wid in range(self.workers):
            self._give(wid, {"task_id": wid, **TASK})

    def release(self) -> None:
        self.stopping = True
        for wid in range(self.workers):
            self._give(wid, "stop")

    def _give(self, wid: int, reply: Any) -> None:
        """``reply`` to client ``wid``'s open poll, whichever kind it is."""
        polls = self.parked.get(wid)
        if polls:
            polls.popleft().answer(reply)
        elif wid in self.queues:
            self.queues[wid].put_nowait(reply)


async def clients(endpoint: str, workers: int) -> None:
    async def one(wid: int) -> None:
        async with RpcClient(endpoint, identity=f"w{wid}".encode(), timeout=WAIT_S + 30) as c:
            while await c.call("poll", {"id": wid, "wait_s": WAIT_S}) != "stop":
                pass
    await asyncio.gather(*(one(i) for i in range(workers)))


async def measure(server: Server, endpoint: str, rounds: int, blocks: int
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Alternating blocks of ``rounds`` rounds: each mode's CPU a poll and pass cost a task,
    a figure a block."""
    workers = server.workers
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    passes: dict[str, list[float]] = {m: [] for m in MODES}
    async with RpcServer(endpoint, {"poll": server.poll}, long_polls={"poll"},
                         max_long_polls_per_peer=4) as rpc:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, SCRIPT, "--clients", rpc.endpoint,
            "--workers", str(workers))

        async def all_open(within_s: float) -> None:
            """Every client's poll open; the clients' process ending first is an error."""
            opened = asyncio.ensure_future(server.all_open.wait())
            ended = asyncio.ensure_future(proc.wait())
            done, _ = await asyncio.wait({opened, ended}, timeout=within_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
            ended.cancel()
            if opened not in done:
                raise RuntimeError(f"the clients' process exited ({proc.returncode}) or "
                                   f"stalled before every poll was open")

        try:
            await all_open(120)
            for block in range(blocks):
                mode = MODES[block % 2]
                server.mode = mode
                server.hand_out()  # the polls open now were opened in the other mode
                await all_open(60)
                start = time.thread_time()
                in_pass = 0.0
                for _ in range(rounds):
                    t = time.thread_time()
                    server.hand_out()
                    in_pass += time.thread_time() - t
                    await all_open(60)
                cpu[mode].append((time.thread_time() - start) / (rounds * workers) * 1e6)
                passes[mode].append(in_pass / (rounds * workers) * 1e6)
            server.release()
            await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    return cpu, passes


async def main_async(workers: int, rounds: int, blocks: int) -> dict[str, Any]:
    run_id = new_run_id()
    try:
        cpu, passes = await measure(Server(workers), ipc_endpoint(run_id, "polls"), rounds,
                                    blocks)
    finally:
        remove_run_dir(run_id)
    out: dict[str, Any] = {}
    for mode in MODES:
        out[f"cpu_us_per_poll_{mode}"] = round(statistics.median(cpu[mode]), 2)
        out[f"pass_us_per_task_{mode}"] = round(statistics.median(passes[mode]), 2)
    out["cpu_ratio_task_vs_parked"] = round(
        out["cpu_us_per_poll_task"] / out["cpu_us_per_poll_parked"], 2)
    out["pass_ratio_task_vs_parked"] = round(
        out["pass_us_per_task_task"] / out["pass_us_per_task_parked"], 2)
    out.update({"workers": workers, "rounds": rounds, "blocks": blocks,
                "cpu_us_per_poll_blocks": [round(x, 1) for m in MODES for x in cpu[m]],
                "pass_us_per_task_blocks": [round(x, 2) for m in MODES for x in passes[m]]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks (even: as many "
                   "of each mode)")
    p.add_argument("--clients", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.clients:
        import uvloop
        uvloop.run(clients(args.clients, args.workers))
        return
    if not 1 <= args.workers <= MAX_WORKERS or args.rounds < 1 or args.blocks < 2:
        p.error(f"--workers must be 1..{MAX_WORKERS}, --rounds >= 1, --blocks >= 2")
    run_and_print(main_async(args.workers, args.rounds, args.blocks))


if __name__ == "__main__":
    main()
