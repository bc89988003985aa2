"""Controller capacity: how many trained samples per second one controller carries.

Simulated workers with near-zero compute (a task is a 1 ms sleep and tensors of 8 tokens), so
the controller, not the work, is what is measured: 64, 256 and 1,024 workers spread over 1, 4
and 8 node agents on this machine. Prints one JSON line.

What is real: the controller (in this process, as `bench/pipeline.py` runs it), its ROUTER and
PUB sockets, the node agents (one process each; the controller's own over ipc, the others over
tcp+curve as on other machines), their shared-memory stores, and every worker's runtime
(`workers.runtime.Worker`: its own DEALER socket and identity, registration, heartbeats, long
polls, store puts and reads, weight loads). What is simulated: the roles' compute
(`workers/sim.py`), and that the workers of one pool on one node share a process as coroutines
(``PoolSpec.per_process``) instead of one process each — 1,024 processes do not fit on 2 cores.
The controller sees 1,024 distinct workers either way.

Keys, per ``<n>w`` (64, 256, 1024 workers):

- ``samples_per_s_<n>w``: trained samples ÷ wall time of `Controller.run` after a warm-up step;
- ``cpu_us_per_sample_<n>w``: the controller process's CPU time (user + system, every thread:
  the event loop and ZeroMQ's I/O threads) ÷ trained samples — the cost this benchmark exists
  to cut;
- ``controller_cpu_share_<n>w``: that CPU time ÷ wall time (near 1.0: the controller is the
  bottleneck; well under: the workers are, on cores they share with it);
- ``event_loop_cpu_share_<n>w``: the part of that CPU time spent in the event loop's thread
  (the rest is ZeroMQ's I/O threads: socket I/O, and curve encryption for other nodes);
- ``agents_cpu_us_per_sample_<n>w`` / ``workers_cpu_us_per_sample_<n>w``: the CPU time of the
  node agents' processes (their stores and relays) / of the worker processes over the same
  steps ÷ trained samples: what the simulated cluster costs a sample. On 2 cores it is what
  bounds the measured rate: the cores offer at most 2e6 ÷ (these two + the controller's)
  samples a second.

And: ``samples_per_s_max``: the highest of the measured rates; ``samples_per_s_ceiling``:
1e6 ÷ ``cpu_us_per_sample_1024w``, the rate a controller with one core of its own sustains at
1,024 workers (the workers here share 2 cores with it, so the measured rate is bounded by their
CPU first); ``dispatch_p50_us_1024w`` / ``dispatch_p99_us_1024w``: from the start of the
dispatch pass that handed a task out (run inline by the report that made it dispatchable) to the
task in the worker's mailbox (`Controller.dispatch_us`): a task's place in its pass, in wall
time, so the tail is the largest passes (a node agent's gathered ``node_served`` hands out a
task to each of its workers that loaded the version) stretched by the machine's load;
``dispatch_cpu_p50_us_1024w`` / ``dispatch_cpu_p99_us_1024w``: the same places counted in the
CPU time of the event loop's thread (`Controller.dispatch_cpu_us`), so without the preemption by
the workers on these shared cores: the tail a controller with a core of its own would see
(a version switch's pass, which hands out the tasks formed for it; a pass admits a chunk
of groups at most, `ADMIT_AHEAD_CHUNK`);
``dispatch_pass_max_tasks_1024w``: the most tasks one pass handed out
(`Controller.dispatch_pass_tasks`); ``version_wait_p50_us_1024w`` /
``version_wait_p99_us_1024w``: from the moment the controller takes a rollout worker's
``served`` entry (the worker idle, a task formed ahead waiting that it may take) to the reply
carrying its task handed to the socket, in wall time (`Controller.version_wait_us`): the rest
of its node's gathered report, the pass, and the replies sent before its own included (a reply
answered while a request is handled leaves as that request ends, with every other one answered
in it: `transport.rpc.Parked.sent`). Until 2026-12-04 it ended at the task's place in the
worker's mailbox, which left out the rest of the pass and the replies;
``reference_us_1024w``: the CPU time of a fixed piece of Python like the controller's (dict and
list operations, small tuples, msgpack round trips of a report's size; `reference_us`) in the
controller's process, before and after the 1,024-worker shape's measured steps (the median of
both), between runs of the controller: how fast this host ran such code at the time, so that
the CPU figures of runs hours or days apart can be told from the host's speed;
``cpu_us_per_sample_1024w_scaled`` / ``dispatch_cpu_p99_us_1024w_scaled``: those two figures
× `FAST_HOST_REFERENCE_US` ÷ ``reference_us_1024w``: what a host that runs the reference in
12 ms (this repository's 2-core machine on its faster hosts, where the targets of ≤ 50 µs a
sample and a dispatch CPU p99 under 1 ms were first measured) would be expected to measure. A
guide, not a measure: code that measured 45.2-47.6 µs a sample there scaled to 41.5-45.6 when
run again on a host 3-5 times slower (bench/README, "Does scaling by the reference hold?"), and
the rate the workers deliver on the shared cores moves the figure more than that;
``controller_rss_mb``: the controller process's resident memory after the 1,024-worker run, and
``controller_rss_growth_mb`` over what it held before starting.

    python bench/capacity.py [--quick] [--rollout-groups N] [--workers-nice N] [--pin]

``--quick`` runs 2 measured steps per shape instead of 8; on 2 shared cores most of its ~2 min
is starting the 25 processes (each imports torch) of the 1,024-worker shape.

``--rollout-groups N``: N groups per rollout task (default 1), so a task carries 4N samples:
the controller's cost is mostly per task (a poll, its reply, a report), so this shows how the
ceiling moves with the task's size (``rollout_groups_per_task`` in the output).

``--episode-turns N``: each response is a multi-turn episode of 1 to N turns (uniform; the
real episode rollout role on the simulated engine, `workers.sim_episode`: 8 tokens a turn, a
tool call between turns that returns at once), so the controller's cost is also stated per turn:
``turns_per_s_<n>w`` (turns of the rollout tasks reported during the run ÷ its wall time) and
``cpu_us_per_turn_<n>w`` (``episode_turns`` in the output). An episode's turns and tool calls
run inside its rollout task on the worker, so the controller's cost per turn is its cost per
sample ÷ the mean turns.

``--workers-nice N``: every process of the run but the controller's (node agents and
workers) runs at niceness N (0: as started). On a cluster the workers run on other machines and
the controller's core is its own; here they share 2 cores, and a dispatch pass of a few ms of
CPU is preempted for tens by 25 worker processes. At N = 10 the kernel gives the controller
~10 times their share whenever it is runnable, which is the closer model of a core of its own
for the dispatch latency (``workers_nice`` in the output).

``--pin``: the controller's process on the first CPU it may use, every other process of the
run (node agents, workers) on the rest (``pinned`` in the output): a core of the controller's
own, as on a cluster: no worker preempts a dispatch pass, so its wall time is its CPU time. The
workers then have one core fewer, so the measured rates fall.

``--node-dispatch``: the agents of the nodes other than the controller's dispatch their rollout
and reward workers' tasks under leases (``PipelineSpec.node_dispatch``; ``node_dispatch`` in the
output; the 64-worker shape has no other node, so it runs as without): the controller's node's
workers are the only ones it hands tasks to, and its ``version_wait`` figures are theirs.

``--profile FILE`` runs only the 1,024-worker shape, 4 measured steps under cProfile (the event
loop's thread), writes the stats to FILE (`pstats`) and prints the calls that count messages:
requests handled by kind, messages sent, function calls in all. Call counts do not depend on the
load; times do.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import math
import os
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import psutil

from bench.pipeline import pct
from bench.runner import run_and_print
from bench.scale import started_with_agents
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from transport.codec import HANDLE_EXT
from transport.rpc import RpcClient

#: near-zero compute: a rollout task is a 1 ms sleep, every response 8 tokens.
COST = {
    "prompt_len": 8, "max_new_tokens": 8, "log_mean": math.log(8), "log_sigma": 0.0,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.0, "train_step_s": 0.0,
    "weight_numel": 1024,
}
GROUP = 4
#: the most turns ``--episode-turns`` takes (an episode's response stays small)
MAX_TURNS = 16
GROUPS_PER_STEP = 256
#: (workers, node agents)
SHAPES = ((64, 1), (256, 4), (1024, 8))


def workload(workers: int, agents: int, rollout_groups: int = 1,
             episode_turns: int = 0, node_dispatch: bool = False,
             ) -> tuple[PipelineSpec, tuple[str, ...]]:
    """``workers`` in all (1/16 reward, one trainer, the rest rollout); rollout and reward
    spread over ``agents`` nodes (the controller's own first), one process per pool and node;
    the trainer on the controller's node. ``rollout_groups``: groups per rollout task;
    ``episode_turns``: each response a multi-turn episode of 1 to that many turns (episodes
    score themselves: no reward stage, and those workers roll out too); ``node_dispatch``: the
    agents of the nodes other than the controller's dispatch their workers (with one agent,
    there is none)."""
    nodes = ("node0", *(f"n{i}" for i in range(1, agents)))
    reward = 0 if episode_turns else max(agents, workers // 16)
    rollout = workers - reward - 1
    pools = [PoolSpec("rollout", count=rollout, per_process=-(-rollout // agents), nodes=nodes)]
    if reward:
        pools.append(PoolSpec("reward", count=reward, per_process=-(-reward // agents),
                              nodes=nodes))
    pools.append(PoolSpec("train", count=1, nodes=("node0",)))
    return PipelineSpec(
        stages=grpo_stages(group_size=GROUP, train_micro_groups=8, reward_micro_batch=32,
                           rollout_micro_groups=rollout_groups, episode=episode_turns > 0),
        pools=tuple(pools),
        group_size=GROUP, groups_per_step=GROUPS_PER_STEP, max_staleness=2, engine="sim",
        engine_config={**COST, **(episodes(episode_turns) if episode_turns else {})},
        store_capacity_bytes=512 << 20, heartbeat_s=1.0,
        heartbeat_timeout_s=60.0, node_dispatch=node_dispatch and agents > 1,
    ), nodes


def episodes(turns: int) -> dict[str, Any]:
    """Near-zero compute for multi-turn episodes too: 1 to ``turns`` turns of 8 tokens each
    (`workers.sim_episode`), a tool call between turns that returns at once with 2 tokens."""
    return {"episode_turns": turns, "tool_s": 0.0, "tool_tokens": 2,
            "max_new_tokens": 8 * turns + 2 * (turns - 1)}


#: `reference_us` on this repository's 2-core machine on its faster hosts (11.9-12.7 ms on
#: 2026-12-05), where the capacity targets were first measured.
FAST_HOST_REFERENCE_US = 12_000.0


def scaled_to_fast_host(us: float, reference: float) -> float:
    """``us`` of CPU measured in a run whose `reference_us` was ``reference``, as a host that
    runs the reference in `FAST_HOST_REFERENCE_US` would be expected to measure it."""
    return us * FAST_HOST_REFERENCE_US / reference


def reference_us(repeats: int = 5) -> float:
    """CPU µs (this thread's) of a fixed piece of Python like the controller's per-task work,
    the median of ``repeats``: dict gets and sets, list appends, small tuples, and msgpack round
    trips of a message of a report's size with handles in their ext form."""
    handle = msgpack.ExtType(HANDLE_EXT, msgpack.packb(["node1", "flowrl-seg", 1024, "int64", [8]]))
    report = msgpack.packb({"worker_id": "w-17", "task_id": 4242, "version": 3,
                            "fields": {f: [handle] * 16 for f in ("a", "b", "c")},
                            "lengths": [8] * 16, "metrics": {"loss": 0.5}})
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        counts: dict[int, int] = {}
        rows: list[tuple[int, str]] = []
        for i in range(20_000):
            counts[i % 97] = counts.get(i % 89, 0) + 1
            rows.append((i, "row"))
        for _ in range(200):
            msgpack.unpackb(msgpack.packb(msgpack.unpackb(report)))
        times.append((time.thread_time() - t0) * 1e6)
    return statistics.median(times)


def loop_cpu(me: psutil.Process) -> float:
    """CPU seconds of this process's main thread (the event loop: everything but ZeroMQ's
    I/O threads)."""
    main = threading.main_thread().native_id
    return next(t.user_time + t.system_time for t in me.threads() if t.id == main)


async def read_every_store(ctl: Controller) -> None:
    """An empty read from every node's store, at the endpoint other nodes read it by (the
    controller's own node's too): a node agent imports torch at the first read from another
    node (~1-2 s of CPU), and one whose rows the warm-up step did not read would import it in
    the measured steps, on the cores the controller runs on."""
    hub = ctl.nodes
    if hub is None:
        return
    for endpoint in list(hub.peers.values()):
        async with RpcClient(endpoint, curve=hub.keys, timeout=120.0) as store:
            await store.call("read", {"ranges": []})


def children_cpu(me: psutil.Process) -> dict[int, tuple[str, float]]:
    """Each process under ``me``: (``agents`` for a node agent, else ``workers``; its CPU
    seconds so far), by pid."""
    out = {}
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            kind = "agents" if "flowrl.node" in p.cmdline() else "workers"
            t = p.cpu_times()
            out[p.pid] = (kind, t.user + t.system)
    return out


def renice_children(me: psutil.Process, nice: int) -> None:
    """Every process under ``me`` (node agents, workers) at niceness ``nice``; a worker
    restarted later inherits its agent's."""
    for p in me.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.nice(nice)


def pin(me: psutil.Process, cpus: list[int]) -> None:
    """This process (the controller) on the first of ``cpus``, every process under it (node
    agents, workers; a worker restarted later inherits its agent's) on the others: a core of
    the controller's own, as on a cluster. ``cpus``: 2 or more (`main` checks)."""
    set_affinity(me, cpus[:1])
    for p in me.children(recursive=True):
        set_affinity(p, cpus[1:])


def set_affinity(p: psutil.Process, cpus: list[int]) -> None:
    """Every thread of ``p`` on ``cpus`` (an affinity set by process id is its main thread's
    only: ZeroMQ's I/O threads, started before, would keep theirs)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for t in p.threads():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(t.id, cpus)


async def measure(workers: int, agents: int, steps: int, rollout_groups: int = 1,
                  profile: cProfile.Profile | None = None,
                  episode_turns: int = 0, workers_nice: int = 0,
                  pinned: bool = False, node_dispatch: bool = False) -> dict[str, Any]:
    spec, nodes = workload(workers, agents, rollout_groups, episode_turns, node_dispatch)
    me = psutil.Process()
    rss0 = me.memory_info().rss
    affinity = me.cpu_affinity()
    async with started_with_agents(spec, nodes) as ctl:
        if workers_nice:
            renice_children(me, workers_nice)
        if pinned:
            pin(me, affinity)
        await ctl.run(steps=1, timeout_s=300)  # warm-up: every worker polling, first version
        await read_every_store(ctl)
        reference = [reference_us()]  # between runs: the controller handles little meanwhile
        ctl.dispatch_us.clear()
        ctl.dispatch_cpu_us.clear()
        ctl.dispatch_pass_tasks.clear()
        ctl.version_wait_us.clear()
        logged = len(ctl.step_log)
        cpu0, loop0, kids0 = me.cpu_times(), loop_cpu(me), children_cpu(me)
        if profile is not None:
            profile.enable()
        try:
            out = await ctl.run(steps=steps, timeout_s=600)
        finally:
            if profile is not None:
                profile.disable()
        cpu1, loop1, kids1 = me.cpu_times(), loop_cpu(me), children_cpu(me)
        cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        cluster = {"agents": 0.0, "workers": 0.0}  # a process restarted meanwhile: not counted
        for pid, (kind, end) in kids1.items():
            if pid in kids0:
                cluster[kind] += end - kids0[pid][1]
        reference.append(reference_us())
        samples = out["samples"]
        if out["rows_trained_twice"]:  # exactly once holds at any load
            raise RuntimeError(f"{out['rows_trained_twice']} rows trained twice")
        turns = sum(float(e.get("rollout_turns", 0.0)) for e in ctl.step_log[logged:])
        set_affinity(me, affinity)  # the next shape starts its processes on every CPU
        return {
            "samples_per_s": out["samples_per_s"], "cpu_us_per_sample": cpu / samples * 1e6,
            "agents_cpu_us_per_sample": cluster["agents"] / samples * 1e6,
            "workers_cpu_us_per_sample": cluster["workers"] / samples * 1e6,
            "turns_per_s": turns / out["wall_s"],
            "cpu_us_per_turn": cpu / turns * 1e6 if turns else None,
            "cpu_share": cpu / out["wall_s"], "loop_share": (loop1 - loop0) / cpu,
            "dispatch_us": list(ctl.dispatch_us),
            "dispatch_cpu_us": list(ctl.dispatch_cpu_us),
            "version_wait_us": list(ctl.version_wait_us),
            "pass_max": max(ctl.dispatch_pass_tasks, default=0),
            "reference_us": statistics.median(reference),
            "rss": me.memory_info().rss, "rss_growth": me.memory_info().rss - rss0,
        }


async def main_async(quick: bool, rollout_groups: int, episode_turns: int = 0,
                     workers_nice: int = 0, pinned: bool = False,
                     node_dispatch: bool = False) -> dict[str, Any]:
    steps = 2 if quick else 8
    result: dict[str, Any] = {}
    runs = {}
    for workers, agents in SHAPES:
        r = runs[workers] = await measure(workers, agents, steps, rollout_groups,
                                          episode_turns=episode_turns,
                                          workers_nice=workers_nice, pinned=pinned,
                                          node_dispatch=node_dispatch)
        result[f"samples_per_s_{workers}w"] = round(r["samples_per_s"], 1)
        result[f"cpu_us_per_sample_{workers}w"] = round(r["cpu_us_per_sample"], 1)
        result[f"controller_cpu_share_{workers}w"] = round(r["cpu_share"], 3)
        result[f"event_loop_cpu_share_{workers}w"] = round(r["loop_share"], 3)
        result[f"agents_cpu_us_per_sample_{workers}w"] = round(r["agents_cpu_us_per_sample"], 1)
        result[f"workers_cpu_us_per_sample_{workers}w"] = round(r["workers_cpu_us_per_sample"],
                                                                1)
        if episode_turns:
            result[f"turns_per_s_{workers}w"] = round(r["turns_per_s"], 1)
            result[f"cpu_us_per_turn_{workers}w"] = round(r["cpu_us_per_turn"], 1)
    big = runs[1024]
    d, dc, vw = big["dispatch_us"], big["dispatch_cpu_us"], big["version_wait_us"]
    dispatch_cpu_p99 = pct(dc, 0.99)
    result.update({
        "samples_per_s_max": max(result[f"samples_per_s_{w}w"] for w, _ in SHAPES),
        "samples_per_s_ceiling": round(1e6 / big["cpu_us_per_sample"]),
        "dispatch_p50_us_1024w": round(statistics.median(d), 1) if d else None,
        "dispatch_p99_us_1024w": round(pct(d, 0.99), 1),
        "dispatch_cpu_p50_us_1024w": round(statistics.median(dc), 1) if dc else None,
        "dispatch_cpu_p99_us_1024w": round(dispatch_cpu_p99, 1),
        "dispatch_pass_max_tasks_1024w": big["pass_max"],
        "version_wait_p50_us_1024w": round(statistics.median(vw), 1) if vw else None,
        "version_wait_p99_us_1024w": round(pct(vw, 0.99), 1) if vw else None,
        "reference_us_1024w": round(big["reference_us"]),
        "cpu_us_per_sample_1024w_scaled": round(
            scaled_to_fast_host(big["cpu_us_per_sample"], big["reference_us"]), 1),
        "dispatch_cpu_p99_us_1024w_scaled": round(
            scaled_to_fast_host(dispatch_cpu_p99, big["reference_us"]), 1),
        "controller_rss_mb": round(big["rss"] / 2**20, 1),
        "controller_rss_growth_mb": round(big["rss_growth"] / 2**20, 1),
        "samples_per_step": GROUPS_PER_STEP * GROUP,
        "rollout_groups_per_task": rollout_groups,
        "episode_turns": episode_turns,
        "workers_nice": workers_nice,
        "pinned": pinned,
        "node_dispatch": node_dispatch,
        "steps": steps,
        "quick": quick,
    })
    return result


#: what `--profile` prints: (file, function) -> key (requests handled by kind, messages sent)
PROFILED = {("worker_api.py", "_register"): "register",
            ("worker_api.py", "_heartbeat"): "heartbeat",
            ("worker_api.py", "_get_task"): "get_task",
            ("worker_api.py", "_served"): "served",
            ("worker_api.py", "_node_served"): "node_served",
            ("worker_api.py", "_node_heartbeat"): "node_heartbeat",
            ("node_hub.py", "_poll"): "node_poll",
            ("_zsocket.py", "send_nowait"): "messages_sent"}


def profiled_counts(path: str) -> dict[str, Any]:
    """The `PROFILED` call counts and totals of the cProfile stats in ``path``."""
    stats: dict[Any, Any] = pstats.Stats(path).stats  # type: ignore[attr-defined]
    counts: dict[str, Any] = {key: 0 for key in PROFILED.values()}
    for (file, _, name), (_, ncalls, *_) in stats.items():
        key = PROFILED.get((Path(file).name, name))
        if key is not None:
            counts[key] += ncalls
    return {"function_calls": sum(v[1] for v in stats.values()),
            "profiled_s": round(sum(v[2] for v in stats.values()), 2), **counts}


async def profile_async(path: str, rollout_groups: int, episode_turns: int = 0,
                        workers_nice: int = 0, pinned: bool = False,
                        node_dispatch: bool = False) -> dict[str, Any]:
    prof = cProfile.Profile()
    r = await measure(1024, 8, 4, rollout_groups, prof, episode_turns, workers_nice, pinned,
                      node_dispatch)
    prof.dump_stats(path)
    return {"samples": 4 * GROUPS_PER_STEP * GROUP,
            "cpu_us_per_sample_1024w": round(r["cpu_us_per_sample"], 1),
            **profiled_counts(path)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps, same keys")
    p.add_argument("--profile", metavar="FILE", help="profile the 1,024-worker shape only")
    p.add_argument("--rollout-groups", type=int, default=1, metavar="N",
                   help="groups of 4 per rollout task (default 1: a task per group)")
    p.add_argument("--episode-turns", type=int, default=0, metavar="N",
                   help="each response a multi-turn episode of 1..N turns (default 0: single)")
    p.add_argument("--workers-nice", type=int, default=0, metavar="N",
                   help="niceness of the node agents and workers (default 0: as started)")
    p.add_argument("--pin", action="store_true",
                   help="the controller on one CPU, the node agents and workers on the others")
    p.add_argument("--node-dispatch", action="store_true",
                   help="the agents of the nodes other than the controller's dispatch their "
                        "workers' rollout and reward tasks under leases")
    args = p.parse_args()
    if not 1 <= args.rollout_groups <= GROUPS_PER_STEP:
        p.error(f"--rollout-groups must be 1..{GROUPS_PER_STEP}")
    if not 0 <= args.episode_turns <= MAX_TURNS:
        p.error(f"--episode-turns must be 0..{MAX_TURNS}")
    if not 0 <= args.workers_nice <= 19:
        p.error("--workers-nice must be 0..19")
    configure(level="warning")
    start = time.perf_counter()
    turns = args.episode_turns
    nice = args.workers_nice
    if args.pin and len(psutil.Process().cpu_affinity()) < 2:
        p.error("--pin needs 2 CPUs or more")
    nd = args.node_dispatch
    run_and_print(profile_async(args.profile, args.rollout_groups, turns, nice, args.pin, nd)
                  if args.profile else
                  main_async(args.quick, args.rollout_groups, turns, nice, args.pin, nd))
    print(f"# {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
