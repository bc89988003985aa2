"""A crowd against the monitor (`bench/fuzz.py` endpoint ``flood``): slow-header connections
and event streams from another process, in alternate windows of one run."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any, Final

import psutil

from bench.fuzz_common import (
    REPLY_WAIT_S,
    Figures,
)
from flowrl.controller import Controller

#: the crowd's process: stdlib only, so that it starts fast and costs little. It reads "on" and
#: "off" lines on stdin (clients connect / all hang up) and prints its counts on "quit".
CROWD = r"""
import asyncio, json, sys
host, port, n_slow, n_streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stats = {"connections": 0, "closed_by_monitor": 0, "busy_503": 0, "streams_served": 0,
         "stream_bytes": 0}

async def connect():
    # The listener may refuse while full: come back shortly.
    while True:
        try:
            conn = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        stats["connections"] += 1
        return conn

async def slowloris(i):
    # A request head that never ends: one more header line a second, until the monitor hangs up.
    while True:
        reader, writer = await connect()
        try:
            writer.write(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            while True:
                try:
                    async with asyncio.timeout(1.0):
                        got = await reader.read(256)
                except TimeoutError:
                    writer.write(b"X-%d: a\r\n" % i)
                    continue
                if got.startswith(b"HTTP/1.1 503"):
                    stats["busy_503"] += 1
                elif not got:
                    stats["closed_by_monitor"] += 1
                break
        except OSError:
            stats["closed_by_monitor"] += 1
        finally:
            writer.close()
        await asyncio.sleep(0.2)

async def stream(i):
    # An event-stream client that reads everything, and comes back at once when refused.
    while True:
        reader, writer = await connect()
        try:
            writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 200"):
                stats["streams_served"] += 1
                while chunk := await reader.read(65536):
                    stats["stream_bytes"] += len(chunk)
            else:
                stats["busy_503"] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
        stats["closed_by_monitor"] += 1
        await asyncio.sleep(0.5)

async def main():
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    tasks = []
    while line := (await stdin.readline()).strip():
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        tasks = []
        if line == b"on":
            tasks = [asyncio.ensure_future(slowloris(i)) for i in range(n_slow)]
            tasks += [asyncio.ensure_future(stream(i)) for i in range(n_streams)]
        elif line == b"quit":
            break
        print("ok", flush=True)
    print(json.dumps(stats), flush=True)

asyncio.run(main())
"""
FLOOD_SLOW: Final = 1000
FLOOD_STREAMS: Final = 300
FLOOD_ROUNDS: Final = 3
FLOOD_WINDOW_S: Final = 6.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def flood_monitor(ctl: Controller, figures: Figures, slow: int, streams: int,
                        rounds: int) -> dict[str, Any]:
    """Alternate quiet and attacked windows (quiet first); in each, the run's steps/s and, in
    the attacked ones, `/status` polled twice a second (each answer must be 200)."""
    import aiohttp

    url = ctl.monitor_url or ""
    port = url.rstrip("/").rsplit(":", 1)[1]
    crowd = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CROWD, "127.0.0.1", port, str(slow), str(streams),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    stdin, stdout = crowd.stdin, crowd.stdout
    assert stdin is not None
    assert stdout is not None
    rates: dict[str, list[float]] = {"quiet": [], "attacked": []}
    # CPU seconds a second of this process (the controller and its monitor) and of the crowd.
    cpu: dict[str, list[float]] = {"controller_attacked": [], "controller_quiet": [],
                                   "crowd_attacked": []}
    me, them = psutil.Process(), psutil.Process(crowd.pid)
    latencies: list[float] = []
    peak_fds = open_fds()

    async def say(line: bytes) -> None:
        stdin.write(line + b"\n")
        await stdin.drain()
        async with asyncio.timeout(60):
            await stdout.readline()

    try:
        # A connection each poll: the monitor evicts idle keep-alive connections when full,
        # and one evicted just as a request goes out on it is reset (at most 2 polls of ~170
        # under this crowd). Browsers retry such a request; this client would count it as failed.
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as http:
            for window in range(2 * rounds):
                attacked = window % 2 == 1
                await say(b"on" if attacked else b"off")
                v0, t0 = ctl.version, time.perf_counter()
                c0, k0 = sum(me.cpu_times()[:2]), sum(them.cpu_times()[:2])
                while (left := FLOOD_WINDOW_S - (time.perf_counter() - t0)) > 0:
                    await asyncio.sleep(min(0.5, left))
                    peak_fds = max(peak_fds, open_fds())
                    if not attacked:
                        continue
                    figures.valid_requests += 1
                    t = time.perf_counter()
                    try:
                        async with asyncio.timeout(REPLY_WAIT_S), http.get(url + "status") as r:
                            ok = r.status == 200 and (await r.json())["run_id"] == ctl.run_id
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        ok = False
                        print(f"/status under the crowd failed: {exc!r}", file=sys.stderr)
                    latencies.append((time.perf_counter() - t) * 1e3)
                    figures.valid_requests_failed += not ok
                wall = time.perf_counter() - t0
                rates["attacked" if attacked else "quiet"].append((ctl.version - v0) / wall)
                side = "attacked" if attacked else "quiet"
                cpu[f"controller_{side}"].append((sum(me.cpu_times()[:2]) - c0) / wall)
                if attacked:
                    cpu["crowd_attacked"].append((sum(them.cpu_times()[:2]) - k0) / wall)
            await say(b"off")
            stdin.write(b"quit\n")
            await stdin.drain()
            async with asyncio.timeout(30):
                counts = json.loads((await stdout.readline()).decode())
                await crowd.wait()
    finally:
        if crowd.returncode is None:
            crowd.kill()
            await crowd.wait()
    figures.messages = counts["connections"]
    quiet = statistics.median(rates["quiet"])
    attacked = statistics.median(rates["attacked"])
    assert ctl.monitor is not None
    return {"slowloris": slow, "streams": streams, "rounds": rounds,
            "window_s": FLOOD_WINDOW_S,
            "steps_per_s_quiet": [round(x, 2) for x in rates["quiet"]],
            "steps_per_s_attacked": [round(x, 2) for x in rates["attacked"]],
            "ratio": round(attacked / quiet, 3) if quiet else None,
            "status_p50_ms": round(statistics.median(latencies), 1) if latencies else None,
            "status_max_ms": round(max(latencies), 1) if latencies else None,
            "peak_fds": peak_fds, "crowd": counts,
            "cpu_per_s": {k: round(statistics.median(v), 2) for k, v in cpu.items() if v},
            "load_avg_1m": round(os.getloadavg()[0], 1),
            "monitor_limits": {"max_connections": ctl.monitor.config.max_connections,
                               "max_event_streams": ctl.monitor.config.max_event_streams}}
