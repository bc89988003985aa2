"""The hang side of the chaos benchmark (`bench/chaos.py`): stopped worker processes and stuck
broadcast subscribers, and the timing of the steps around them.

A stopped process is never resumed: the controller must find it (missed heartbeats), kill it
and restart it. A stuck subscriber is a local process that joins the run's broadcasts and then
stops (`bench/stuck_subscriber.py`). `step_timing` bounds each gap between committed steps by
one median step plus, per worker that went down in it, the heartbeat timeout, the restart
backoff and the longest restart start-up measured in the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from flowrl.controller import Controller

#: a hang is found within a couple of seconds: a heartbeat every 0.2 s, down after 2 s without.
HEARTBEAT_S = 0.2
HEARTBEAT_TIMEOUT_S = 2.0
STUCK_SUBSCRIBER = Path(__file__).resolve().parent / "stuck_subscriber.py"
#: how long a stuck subscriber may take to start and join.
STALL_JOIN_S = 60.0


def kill_stopped(pids: Sequence[int]) -> int:
    """SIGKILL those of ``pids`` that are still stopped children of this process (the controller
    should have killed each one); how many there were."""
    left = 0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            if proc.ppid() == os.getpid() and proc.status() == psutil.STATUS_STOPPED:
                proc.kill()  # the controller's supervisor reaps it
                left += 1
    return left


async def start_stuck_subscribers(ctl: Controller, n: int) -> list[asyncio.subprocess.Process]:
    """``n`` local processes that join ``ctl``'s broadcasts and stop (`STUCK_SUBSCRIBER`);
    each has joined when this returns."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for i in range(n):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(STUCK_SUBSCRIBER), ctl.workforce.endpoints.broadcast,
                f"stuck-subscriber.{i}", ctl.run_id, stdout=asyncio.subprocess.PIPE)
            procs.append(proc)
            assert proc.stdout is not None
            async with asyncio.timeout(STALL_JOIN_S):
                line = await proc.stdout.readline()
            if line.strip() != b"joined":
                raise RuntimeError(f"stuck subscriber {i} did not join (exit {proc.returncode})")
    except BaseException:
        await end_processes(procs)
        raise
    return procs


async def end_processes(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # SIGKILL: a stopped process leaves any other signal pending
    await asyncio.gather(*(p.wait() for p in procs))


# ---- step timing ---------------------------------------------------------------------------------


async def record(ctl: Controller, into: list[dict[str, Any]]) -> None:
    """The times of ``ctl``'s step commits, restarts and workers coming up, as they happen."""
    async for e in ctl.events.subscribe():
        if e["kind"] in ("step", "worker_restart", "worker_up", "worker_down"):
            into.append({k: e[k] for k in ("kind", "time", "process", "name", "role", "why")
                         if k in e})


def _restart_ups(events: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds from each restarted process's start to its worker's registration."""
    ups = []
    for i, e in enumerate(events):
        if e["kind"] == "worker_restart":
            up = next((u["time"] for u in events[i:] if u["kind"] == "worker_up"
                       and u["name"].rsplit(".", 1)[0] == e["process"]), None)
            if up is not None:
                ups.append(up - e["time"])
    return ups


def step_timing(events: Sequence[dict[str, Any]], chaos_end: float,
                backoff_s: float) -> dict[str, Any]:
    """The chaos phase's step gaps against their bounds (see the module docstring)."""
    commits = [e["time"] for e in events if e["kind"] == "step"]
    step_s = statistics.median(b - a for a, b in itertools.pairwise(commits)) if len(
        commits) > 1 else 0.0
    ups = _restart_ups(events)
    up_s = max(ups, default=0.0)
    downs = [e for e in events if e["kind"] == "worker_down"]

    def downs_in(a: float, b: float) -> list[str]:
        # A fault just before a commit delays the next one.
        return [f"{e['role']}: {e['why'][:40]}" for e in downs if a - step_s <= e["time"] <= b]

    def bound(a: float, b: float) -> float:
        recovery = HEARTBEAT_TIMEOUT_S + backoff_s + up_s
        return step_s + max(1, len(downs_in(a, b))) * recovery

    # The phase's end closes a last gap: a run that stops committing has one open.
    spans = list(itertools.pairwise([*(t for t in commits if t <= chaos_end), chaos_end]))
    a, b = max(spans, key=lambda ab: ab[1] - ab[0], default=(0.0, 0.0))
    return {
        "max_step_gap_s": round(b - a, 2), "step_gap_bound_s": round(bound(a, b), 2),
        "step_gap_ok": bool(spans) and all(y - x <= bound(x, y) for x, y in spans),
        "max_step_gap_downs": downs_in(a, b),
        "step_gap_terms": {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "backoff_s": backoff_s,
                           "restart_up_s": round(up_s, 2), "step_s": round(step_s, 3)},
        "restart_up_s": {"median": round(statistics.median(ups), 2) if ups else None,
                         "max": round(up_s, 2) if ups else None},
        "hangs_detected": sum(1 for e in downs if e["why"].startswith(
            ("missed heartbeats", "stopped reading broadcasts"))),
    }


# ---- the phases ----------------------------------------------------------------------------------
