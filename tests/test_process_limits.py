"""Room for many sockets in one process (`transport.process_limits`): past ZeroMQ's default of
1,023 sockets and a low soft limit of open files, and a clear error where the hard limit is too
low; and a real worker process hosting 600 simulated workers (about 1,800 sockets) that starts
and trains."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowrl.controller import Controller
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from tests.test_controller_sim import FAST
from workers.main import SOCKETS_PER_WORKER

ROOT = Path(__file__).resolve().parents[1]

# A fresh process (ZeroMQ's context is process-wide): limit its open files, maybe make room,
# then open sockets with a connection each until the count or an error; print what happened.
# Each connects to a port of another process or of none, as a worker's socket connects to its
# controller: one file for the socket and one for its connection. A server in this process
# would add the accepted side's file as its I/O thread caught up, a third a socket sooner or
# later by the scheduling.
PROBE = textwrap.dedent("""
    import resource, socket, sys, zmq
    soft, hard, room, count = (int(a) for a in sys.argv[1:5])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    from transport.process_limits import SocketRoomError, make_room
    if room:
        try:
            make_room(room, what="the probe")
        except SocketRoomError as exc:
            print("refused:", exc)
            sys.exit(0)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    ctx = zmq.Context.instance()
    socks = []
    try:
        for _ in range(count):
            s = ctx.socket(zmq.DEALER)
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
        print("made", len(socks), "soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except zmq.ZMQError as exc:
        print("failed at", len(socks), exc)
    for s in socks:
        s.close(0)
    ctx.term()
""")


def probe(soft: int, hard: int, room: int, count: int) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, *map(str, (soft, hard, room, count))],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_room_for_more_sockets_than_zeromqs_default_and_the_soft_limit() -> None:
    # Without room: ZeroMQ's 1,023 sockets.
    assert probe(20000, 20000, 0, 1200) == "failed at 1023 Too many open files"
    # A soft limit of 1,024 open files is the common default: with room it is raised.
    assert probe(1024, 20000, 1300, 1200).startswith("made 1200 soft ")
    assert int(probe(1024, 20000, 1300, 1200).split()[-1]) >= 1300 * 2
    # A hard limit too low for them: refused, saying what to change.
    out = probe(1024, 2048, 1300, 1200)
    assert out.startswith("refused: the probe needs about 2856 open files (1300 sockets) and "
                          "the hard limit is 2048: host fewer workers in one process, or "
                          "raise the limit (ulimit -Hn)"), out


@pytest.mark.timeout(120)
async def test_a_process_of_600_simulated_workers_starts_and_trains() -> None:
    rollout = 600  # 3 sockets each in one process: past ZeroMQ's default of 1,023
    assert 3 * rollout > 1023
    assert SOCKETS_PER_WORKER >= 3
    spec = PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=rollout, per_process=rollout),
               PoolSpec("reward", count=1), PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=0, engine="sim", engine_config=FAST,
        store_capacity_bytes=64 << 20, heartbeat_s=0.5, heartbeat_timeout_s=10.0)
    async with Controller(spec, start_timeout_s=90) as ctl:
        out = await ctl.run(steps=2, timeout_s=60)
        status = ctl.status()
    assert out["samples"] == 2 * 4 * 4
    assert out["rows_trained_twice"] == 0
    assert status["worker_deaths"] == 0
