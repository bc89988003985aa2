"""Node-local dispatch on vs off: `bench/capacity.py`'s workload at one shape, runs alternating.

The same simulated near-zero-compute run as `capacity.py` (its `workload`: 1/16 of the workers
reward, one trainer, the rest rollout, spread over the node agents), with
``PipelineSpec.node_dispatch`` off and on in turn, so both see the same machine load. With it on
the agents of the nodes other than the controller's dispatch their rollout and reward workers'
tasks under leases; train stays central (docs/architecture.md, node-local dispatch). Prints one
JSON line: per setting, the samples/s and the controller's CPU µs per trained sample of every
run, their medians, and the tasks leased in the last run with it on (``tasks_leased_on``, of
which rollout's: ``rollout_tasks_leased_on``).

    python bench/node_dispatch.py [--workers 256] [--agents 4] [--rounds 2] [--steps 2]

``--polls 8,128,512`` measures instead what a task costs the agent's hand-out with that many of
its workers' polls waiting (`LocalDispatch`, each poll a coroutine as the agent's server runs
it; no sockets): leases of one task each, the agent's CPU µs a task
(``agent_us_per_task_<N>_polls``, the best of ``--rounds``), and its ratio between the most
and the fewest polls (``agent_task_cost_ratio``: ~1 when a grant wakes only the polls it has
tasks for). And the same for tasks that need the next policy version
(``agent_us_per_versioned_task_<N>_polls``, ``agent_versioned_task_cost_ratio``): each round,
one grant of a task per poll, which none of the waiting polls may run yet, then every worker's
``served`` report of that version in turn, each handing its worker a task.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil

from bench.capacity import workload
from bench.runner import int_list, run_and_print
from bench.scale import started_with_agents
from flowrl.logs import configure
from flowrl.node_dispatch import LocalDispatch


async def measure(workers: int, agents: int, steps: int, node_dispatch: bool) -> dict[str, Any]:
    spec, nodes = workload(workers, agents)
    spec = dataclasses.replace(spec, node_dispatch=node_dispatch)
    me = psutil.Process()
    async with started_with_agents(spec, nodes) as ctl:
        await ctl.run(steps=1, timeout_s=300)  # warm-up: every worker polling, first version
        cpu0 = me.cpu_times()
        out = await ctl.run(steps=steps, timeout_s=600)
        cpu1 = me.cpu_times()
        if out["rows_trained_twice"]:  # exactly once holds at any load
            raise RuntimeError(f"{out['rows_trained_twice']} rows trained twice")
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        leases = ctl.node_leases
        return {"samples_per_s": round(out["samples_per_s"], 1),
                "cpu_us_per_sample": round(cpu / out["samples"] * 1e6, 1),
                "tasks_leased": None if leases is None else leases.tasks_leased,
                "rollout_leased": None if leases is None else leases.rollout_leased}


async def main_async(workers: int, agents: int, rounds: int, steps: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for key in ("off", "on"):
            runs[key].append(await measure(workers, agents, steps, key == "on"))
    out: dict[str, Any] = {"workers": workers, "agents": agents, "steps": steps,
                           "load_avg_1m": round(psutil.getloadavg()[0], 1)}
    for key, rs in runs.items():
        out[f"samples_per_s_{key}"] = [r["samples_per_s"] for r in rs]
        out[f"cpu_us_per_sample_{key}"] = [r["cpu_us_per_sample"] for r in rs]
        out[f"samples_per_s_{key}_median"] = round(
            statistics.median(out[f"samples_per_s_{key}"]), 1)
        out[f"cpu_us_per_sample_{key}_median"] = round(
            statistics.median(out[f"cpu_us_per_sample_{key}"]), 1)
    out["tasks_leased_on"] = runs["on"][-1]["tasks_leased"]
    out["rollout_tasks_leased_on"] = runs["on"][-1]["rollout_leased"]
    return out


STAGE = "reward"


@contextlib.asynccontextmanager
async def polling(agent: LocalDispatch, ids: list[str]) -> AsyncIterator[list[int]]:
    """A worker of each id polling ``agent`` for tasks, reporting each at once and polling
    again, every poll waiting when this enters; yields the ids of the tasks taken."""
    taken: list[int] = []

    async def worker(wid: str) -> None:
        while True:
            msg = await agent.take(wid, STAGE, 600.0)
            if msg is not None:
                taken.append(msg["task_id"])
                agent.done(wid, {"worker_id": wid, "task_id": msg["task_id"], "fields": {},
                                 "lengths": [], "version": None, "metrics": {}})

    workers = [asyncio.create_task(worker(wid)) for wid in ids]
    await asyncio.sleep(0)  # every poll waits
    # A full collection of this process's heap (~0.1 s with torch imported) came in one
    # measure in ~5 and made it 3-5 times the others: collect before, not during.
    gc.collect()
    try:
        yield taken
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


def each_once(taken: list[int], tasks: int) -> None:
    if sorted(taken) != list(range(tasks)):
        raise AssertionError(f"{len(taken)} tasks taken of {tasks}, or one taken twice")


async def hand_out_cpu_us(polls: int, tasks: int) -> float:
    """The agent's CPU µs a task with ``polls`` workers' polls waiting, a lease of one task at
    a time; every task reaches exactly one worker, which reports it and polls again."""
    agent = LocalDispatch("bench")
    agent.joined(1)
    async with polling(agent, [f"w{i}" for i in range(polls)]) as taken:
        start = time.thread_time()
        for i in range(tasks):
            agent.add_lease({"lease": i, "epoch": 1, "stage": STAGE,
                             "tasks": [{"task_id": i, "stage": STAGE, "rows": [i]}]})
            await asyncio.sleep(0)  # the woken poll returns its task,
            await asyncio.sleep(0)  # and its worker polls again
        cpu = time.thread_time() - start
    each_once(taken, tasks)
    return cpu / tasks * 1e6


async def versioned_hand_out_cpu_us(polls: int, tasks: int) -> float:
    """The agent's CPU µs a task with ``polls`` workers' polls waiting for tasks that need the
    next version: a grant of one task per poll, then each worker's ``served`` of it in turn
    (rollout tasks formed ahead of a version). Every task reaches exactly one worker."""
    agent = LocalDispatch("bench")
    agent.joined(1)
    ids = [f"w{i}" for i in range(polls)]
    versions = -(-tasks // polls)
    async with polling(agent, ids) as taken:
        start = time.thread_time()
        for v in range(1, versions + 1):
            first = (v - 1) * polls
            agent.add_lease({"lease": v, "epoch": 1, "stage": STAGE, "needs": [v] * polls,
                             "tasks": [{"task_id": first + i, "stage": STAGE,
                                        "rows": [first + i]} for i in range(polls)]})
            for wid in ids:
                agent.serving(wid, v)
            await asyncio.sleep(0)  # the woken polls return their tasks,
            await asyncio.sleep(0)  # and their workers poll again
        cpu = time.thread_time() - start
    each_once(taken, versions * polls)
    return cpu / (versions * polls) * 1e6


async def polls_async(counts: list[int], tasks: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tasks": tasks, "rounds": rounds,
                           "load_avg_1m": round(psutil.getloadavg()[0], 1)}
    for kind, measure in (("task", hand_out_cpu_us), ("versioned_task", versioned_hand_out_cpu_us)):
        best: dict[int, float] = {}
        for _ in range(rounds):  # the counts alternate, so each sees the same load
            for n in counts:
                us = await measure(n, tasks)
                best[n] = min(best.get(n, us), us)
        for n in counts:
            out[f"agent_us_per_{kind}_{n}_polls"] = round(best[n], 1)
        out[f"agent_{kind}_cost_ratio"] = round(best[max(counts)] / best[min(counts)], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs (with --polls: rounds)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per run")
    p.add_argument("--polls", type=int_list(1, "numbers of polls"), default=None,
                   help="comma-separated numbers of waiting polls: the agent's hand-out alone")
    p.add_argument("--tasks", type=int, default=2000, help="with --polls: tasks a measure")
    args = p.parse_args()
    configure(level="warning")
    start = time.perf_counter()
    if args.polls:
        run_and_print(polls_async(args.polls, args.tasks, args.rounds))
    else:
        run_and_print(main_async(args.workers, args.agents, args.rounds, args.steps))
    print(f"# {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
