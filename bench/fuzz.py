"""Bad input against every process that reads the network: does anything die, hang or leak?

Four endpoints, each fuzzed with malformed messages while valid requests are interleaved (and
must all succeed):

- ``controller``: the controller's RPC server during a real simulated run; afterwards the run
  must stop cleanly with exact accounting (every step trained in full, no row trained twice,
  no worker lost);
- ``store``: the node agent's StoreServer (a real SampleStore in its own process) during that
  same run, so the workers' real store traffic is the valid traffic next to ours;
- ``worker``: a real worker process (``python -m workers.main``, engine sim) served by a hostile
  controller that answers its calls with malformed replies and task messages and publishes
  malformed broadcasts; the worker must keep serving the valid tasks mixed in, exit on ``stop``,
  and exit with a clear error (never hang) when its registration is answered with garbage;
- ``monitor``: the controller's HTTP monitor: garbage, bad methods, huge headers, bad JSON
  bodies, missing or wrong tokens, path traversal, bad event ids;
- ``flood``: the monitor under a crowd, from another process: slow-header (slowloris)
  connections that never finish their request and many event-stream clients, switched on and
  off in alternate windows of the same run. Reports the run's steps/s with and without the
  crowd (``flood.ratio``, attacked over quiet), the monitor's `/status` answers during it and
  this process's peak file-descriptor count.

Message kinds (RPC): random bytes, truncated frames, msgpack of the right shape with a field of
the wrong type or range, tensor headers declaring terabytes, unknown operations, replays with
invalid request ids, extra and missing frames. Mutations are always invalid for their field:
a well-formed request is not bad input, and the fuzzer does not impersonate the run's own
processes (loopback peers are the run's processes; cross-node transport is authenticated).

Prints one JSON line: ``messages``, ``crashes``, ``valid_requests_failed``, ``peak_rss_mb`` and
a breakdown per endpoint.

    python -m bench.fuzz [--quick] [--endpoint controller,store,worker,monitor,flood]
                         [--messages N] [--flood SLOW,STREAMS] [--flood-rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch  # noqa: F401  (the fuzzer builds tensor frames: loaded before any RSS baseline)
import zmq
import zmq.asyncio

from bench.fuzz_common import (
    ENDPOINTS,
    FULL_MESSAGES,
    GROUP,
    GROUPS_PER_STEP,
    QUICK_MESSAGES,
    Figures,
    peak_rss_mb,
    rss_mb,
    sim_spec,
)
from bench.fuzz_flood import FLOOD_ROUNDS, FLOOD_SLOW, FLOOD_STREAMS, FLOOD_WINDOW_S, flood_monitor
from bench.fuzz_http import HttpFindings, fuzz_monitor
from bench.fuzz_messages import Gen
from bench.fuzz_rpc import (
    controller_templates,
    controller_valid,
    fuzz_rpc,
    store_templates,
    store_valid,
)
from bench.fuzz_worker import fuzz_worker
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.recipe import MonitorConfig

# ---- the controller run (endpoints controller, store, monitor) -------------------------------


def _node_agent_pid() -> int:
    for child in psutil.Process().children(recursive=True):
        try:
            if "flowrl.node" in child.cmdline():
                return int(child.pid)
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError("no node agent process found")


async def fuzz_run(endpoints: list[str], count: int, seed: int,
                   flood: tuple[int, int, int] = (FLOOD_SLOW, FLOOD_STREAMS, FLOOD_ROUNDS),
                   ) -> dict[str, Any]:
    """One real simulated run, fuzzed endpoint by endpoint while it goes on; then stopped and
    its accounting checked. `flood`: slowloris connections, event streams, rounds."""
    out: dict[str, Any] = {}
    me = os.getpid()
    monitor = MonitorConfig() if {"monitor", "flood"} & set(endpoints) else None
    ctx = zmq.asyncio.Context()
    try:
        async with Controller(sim_spec(), monitor=monitor) as ctl:
            run = asyncio.ensure_future(ctl.run(steps=10**6))
            await ctl.wait_for(lambda: ctl.version >= 1)
            version0 = ctl.version
            node_pid = _node_agent_pid()
            for name in endpoints:
                fig = Figures()
                pid = node_pid if name == "store" else me
                fig.rss_start_mb = rss_mb(pid)
                t0 = time.perf_counter()
                if name == "controller":
                    templates, harmless = controller_templates()
                    await fuzz_rpc(ctl.workforce.endpoints.controller,
                                   Gen(seed, templates, harmless), count, controller_valid(),
                                   fig, ctx)
                    # No malformed registration was taken for a worker.
                    fig.valid_requests += 1
                    if len(ctl.registry) != sum(p.count for p in ctl.spec.pools):
                        fig.valid_requests_failed += 1
                        print(f"registry holds {len(ctl.registry)} workers", file=sys.stderr)
                elif name == "store":
                    templates, harmless = store_templates(ctl.run_id, me)
                    await fuzz_rpc(ctl.workforce.endpoints.store,
                                   Gen(seed + 1, templates, harmless), count,
                                   store_valid(ctl.run_id, node_pid), fig, ctx)
                    fig.crashes += not psutil.Process(node_pid).is_running()
                elif name == "flood":
                    out["flood_report"] = await flood_monitor(ctl, fig, *flood)
                else:
                    findings = HttpFindings()
                    await fuzz_monitor(ctl, count, seed + 2, fig, findings)
                    out.setdefault("monitor_findings", asdict(findings))
                fig.wall_s = time.perf_counter() - t0
                fig.rss_end_mb = rss_mb(pid)
                fig.peak_rss_mb = peak_rss_mb(pid)
                out[name] = fig
            progressed = ctl.version - version0
            ctl.stop()
            async with asyncio.timeout(60):
                await run
    finally:
        ctx.destroy(linger=0)
    # Counted once the controller has closed: the step being trained when `stop` came still
    # commits after `run` returned (its rows are trained, not dropped), so the run's summary
    # may be one step behind the controller's final state.
    status = ctl.status()
    steps = ctl.version
    accounting = {
        "steps": steps,
        "steps_during_fuzz": progressed,
        "samples": status["samples_trained"],
        "rows_trained": ctl.rows_trained,
        "rows_trained_twice": ctl.rows_trained_twice,
        "stale_dropped": ctl.stale_dropped,
        "worker_deaths": status["worker_deaths"],
        "restarts": status["restarts"],
        "errors": len(status["errors"]),
    }
    ok = (steps == len(ctl.step_log) and progressed > 0
          and all(e["samples"] == GROUP * GROUPS_PER_STEP for e in ctl.step_log)
          and status["samples_trained"] == steps * GROUP * GROUPS_PER_STEP == ctl.rows_trained
          and ctl.rows_trained_twice == 0 and status["worker_deaths"] == 0
          and status["restarts"] == 0 and not status["errors"])
    accounting["ok"] = ok
    out["run"] = accounting
    if not ok:  # the run is the valid traffic of the controller and store endpoints
        for name in ("controller", "store"):
            if name in out:
                out[name].valid_requests_failed += 1
        print(f"run accounting wrong: {accounting}", file=sys.stderr)
    return out


# ---- main ------------------------------------------------------------------------------------


async def main_async(endpoints: list[str], count: int, seed: int,
                     flood: tuple[int, int, int] = (FLOOD_SLOW, FLOOD_STREAMS, FLOOD_ROUNDS),
                     ) -> dict[str, Any]:
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    in_run = [e for e in endpoints if e != "worker"]
    if in_run:
        results.update(await fuzz_run(in_run, count, seed, flood))
    if "worker" in endpoints:
        results.update(await fuzz_worker(count, seed + 3))
    figures = {e: results.pop(e) for e in endpoints}
    return {
        "bench": "fuzz",
        "messages_per_endpoint": count,
        "messages": sum(f.messages for f in figures.values()),
        "crashes": sum(f.crashes for f in figures.values()),
        "valid_requests_failed": sum(f.valid_requests_failed for f in figures.values()),
        "peak_rss_mb": round(max(f.peak_rss_mb for f in figures.values()), 1),
        "endpoints": {e: f.as_dict() for e, f in figures.items()},
        **results,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_MESSAGES} messages per endpoint instead of {FULL_MESSAGES}")
    p.add_argument("--messages", type=int, default=None, help="messages per endpoint")
    p.add_argument("--endpoint", default=",".join(ENDPOINTS),
                   help=f"comma-separated subset of {','.join(ENDPOINTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flood", default=f"{FLOOD_SLOW},{FLOOD_STREAMS}", metavar="SLOW,STREAMS",
                   help="the flood's slowloris connections and event-stream clients")
    p.add_argument("--flood-rounds", type=int, default=FLOOD_ROUNDS,
                   help=f"quiet and attacked windows of {FLOOD_WINDOW_S:g} s each")
    args = p.parse_args(argv)
    try:
        slow, streams = (int(n) for n in args.flood.split(","))
    except ValueError:
        p.error("--flood takes two integers: SLOW,STREAMS")
    endpoints = [e for e in args.endpoint.split(",") if e]
    unknown = set(endpoints) - set(ENDPOINTS)
    if unknown:
        p.error(f"unknown endpoint(s) {sorted(unknown)}")
    count = args.messages or (QUICK_MESSAGES if args.quick else FULL_MESSAGES)
    configure(level="error")
    flood = (slow, streams, args.flood_rounds)
    print(json.dumps(asyncio.run(main_async(endpoints, count, args.seed, flood))), flush=True)


if __name__ == "__main__":
    main()
