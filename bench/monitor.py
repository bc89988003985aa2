"""What watching costs: throughput with the HTTP monitor off vs on with an open dashboard.

The simulated GRPO workload of `bench/pipeline.py` (max_staleness 1) runs alternately without
a monitor and with one that a separate "dashboard" process watches the way the page does: the
event stream open, `/status` and the newest `/trace` spans fetched every second. Rounds
alternate (off, on, off, on, ...) so drift in machine load hits both sides alike. Also reports
`/status` latency while the run goes at full speed. Prints one JSON line.

    python bench/monitor.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline import workload
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.recipe import MonitorConfig

# The dashboard's traffic, from another process (a browser tab is not in the controller).
DASHBOARD = r"""
import asyncio, sys, time, aiohttp
url = sys.argv[1]
async def main():
    async with aiohttp.ClientSession() as s:
        async def events():
            async with s.get(url + "events") as r:
                async for _ in r.content:
                    pass
        asyncio.get_running_loop().create_task(events())
        after = 0
        lat = []
        while True:
            t = time.perf_counter()
            async with s.get(url + "status") as r:
                await r.read()
            lat.append((time.perf_counter() - t) * 1e3)
            async with s.get(url + f"trace?after={after}") as r:
                await r.read()
            after = int(time.time() * 1e6) - 2_000_000
            print(f"{lat[-1]:.3f}", flush=True)
            await asyncio.sleep(1.0)  # the page refreshes once a second
asyncio.run(main())
"""


async def one_round(steps: int, watched: bool) -> dict[str, Any]:
    monitor = MonitorConfig() if watched else None
    async with Controller(workload(1), monitor=monitor) as ctl:
        await ctl.run(steps=1, timeout_s=120)
        viewer = None
        if watched:
            assert ctl.monitor_url is not None
            viewer = await asyncio.create_subprocess_exec(
                sys.executable, "-c", DASHBOARD, ctl.monitor_url,
                stdout=asyncio.subprocess.DEVNULL)
        try:
            out = await ctl.run(steps=steps, timeout_s=600)
            if watched:
                out["status_ms"] = await _status_latency(ctl)
        finally:
            if viewer is not None:
                viewer.terminate()
                await viewer.wait()
        return out


async def _status_latency(ctl: Controller, n: int = 200) -> list[float]:
    """`/status` round trips from this process while the pipeline keeps running."""
    import aiohttp

    lat: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t = time.perf_counter()
            async with s.get(f"{ctl.monitor_url}status") as r:
                await r.read()
            lat.append((time.perf_counter() - t) * 1e3)
    return lat


async def main_async(quick: bool) -> dict[str, Any]:
    steps, rounds = (8, 2) if quick else (20, 4)
    off: list[float] = []
    on: list[float] = []
    status_ms: list[float] = []
    for _ in range(rounds):
        off.append((await one_round(steps, False))["samples_per_s"])
        r = await one_round(steps, True)
        on.append(r["samples_per_s"])
        status_ms.extend(r["status_ms"])
    s_off, s_on = statistics.median(off), statistics.median(on)
    status_ms.sort()
    return {
        "samples_per_s_off": round(s_off, 1),
        "samples_per_s_on": round(s_on, 1),
        "monitor_cost_share": round(1 - s_on / s_off, 4),
        "status_p50_ms": round(status_ms[len(status_ms) // 2], 2),
        "status_p99_ms": round(status_ms[int(0.99 * (len(status_ms) - 1))], 2),
        "rounds": rounds,
        "steps": steps,
        "quick": quick,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer rounds (< 60 s), same keys")
    args = p.parse_args()
    configure(level="warning")
    print(json.dumps(asyncio.run(main_async(args.quick))))


if __name__ == "__main__":
    main()
