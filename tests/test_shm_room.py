"""A store larger than the shared memory left is refused at start, naming ``/dev/shm`` and its
free space (a tmpfs written past its size kills whoever touches the page with SIGBUS, long after
the start): by `transport.shm.check_room`, the store, the controller's node agent and the
launcher."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrl.controller import Controller, RunError
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.procs import Child, Supervisor
from transport import shm
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir
from transport.errors import SharedMemoryTooSmall
from transport.store import SampleStore

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(90)


def too_big(directory: Path = shm.SHM_DIR) -> int:
    """A capacity `directory` cannot hold, whatever others write meanwhile."""
    return shm.free_bytes(directory) + (1 << 30)


def test_check_room_names_the_directory_and_its_free_space(tmp_path: Path) -> None:
    shm.check_room(1 << 20, tmp_path)
    with pytest.raises(SharedMemoryTooSmall, match=rf"^{tmp_path} has [\d.]+ MiB free, less "
                       r"than the store's capacity of [\d.]+ MiB: workers would die of SIGBUS"):
        shm.check_room(too_big(tmp_path), tmp_path)


def test_a_store_larger_than_dev_shm_is_refused_and_leaves_nothing() -> None:
    run_id = f"t{new_run_id()}"
    with pytest.raises(SharedMemoryTooSmall, match=r"^/dev/shm has .* MiB free"):
        SampleStore(run_id, "node0", capacity_bytes=too_big())
    assert not shm.run_dir_path(run_id).exists()
    assert shm.list_segments(f"flowrl-{run_id}-") == []


async def test_the_run_stops_at_start_and_the_agent_says_why(
    capfd: pytest.CaptureFixture[str],
) -> None:
    spec = PipelineSpec(
        stages=grpo_stages(group_size=4),
        pools=(PoolSpec("rollout"), PoolSpec("reward"), PoolSpec("train")),
        group_size=4, groups_per_step=2, engine="sim", store_capacity_bytes=too_big())
    with pytest.raises(RunError, match="node agent node:node0 exited with code 1"):
        async with Controller(spec, start_timeout_s=60):
            pass
    out, err = capfd.readouterr()  # the agent's lines, relayed by the controller's log
    assert "node agent cannot start its store" in out + err
    assert "/dev/shm has" in out + err


async def test_the_agents_reason_reaches_its_supervisor() -> None:
    """The node agent's last error line is kept with its process, for the run's error."""
    exits: asyncio.Queue[tuple[Child, int]] = asyncio.Queue()
    supervisor = Supervisor(lambda child, code: exits.put_nowait((child, code)))
    run_id = new_run_id()
    try:
        await supervisor.spawn("node:n", [
            sys.executable, "-m", "flowrl.node", "--run-id", run_id, "--node", "n",
            "--controller", ipc_endpoint(run_id, "ctl"), "--store", ipc_endpoint(run_id, "s"),
            "--capacity", str(too_big())])
        async with asyncio.timeout(60):
            child, code = await exits.get()
    finally:
        await supervisor.stop_all(grace_s=1.0)
        remove_run_dir(run_id)
    assert code == 1
    assert child.last_error.startswith("node agent cannot start its store: /dev/shm has ")


def test_the_launcher_refuses_before_anything_starts() -> None:
    mib = too_big() >> 20
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", "recipes/sim_grpo.py", "--no-monitor",
         "--set", f"placement.store_capacity_mb={mib}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "FLOWRL_LOG_FORMAT": "json"})
    assert done.returncode != 0
    assert "error: /dev/shm has" in done.stderr, done.stderr[-2000:]
    assert f"placement.store_capacity_mb = {mib}" in done.stderr
    assert '"run_id"' not in done.stderr  # no controller ever started
