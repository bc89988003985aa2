"""The workforce on its own, with real child processes: a data-parallel group's failure is
blamed on the rank that caused it whichever news reaches the controller first, and a rank that
dies before it registers takes the group down instead of being waited for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import pytest

from flowrl import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    TinyModelConfig,
    TrainerConfig,
)
from flowrl.control.workforce import Workforce
from flowrl.events import EventBus
from flowrl.registry import Registry, WorkerInfo
from transport.endpoints import new_run_id, remove_run_dir

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def two_ranks(failed: asyncio.Queue[str]) -> Workforce:
    """A workforce for two data-parallel trainer ranks and no restarts; run failures go to
    ``failed``."""
    spec = Recipe(
        steps=1, model=ModelConfig(tiny=TinyModelConfig()), data=DataConfig(),
        algorithm=AlgorithmConfig(group_size=2), trainer=TrainerConfig(ranks=2),
        placement=PlacementConfig(max_restarts=0),
    ).to_pipeline()
    return Workforce(
        spec, run_id=new_run_id(), node="node0", registry=Registry(5.0), events=EventBus(),
        hub=None, rendezvous=None, train_role="train", ranked=True,
        worker_gone=lambda worker_id, why: None, fail_run=failed.put_nowait,
        stopping=lambda: False)


@pytest.mark.timeout(60)
async def test_a_survivors_failed_micro_batch_heard_first_still_blames_the_dead_rank() -> None:
    failed: asyncio.Queue[str] = asyncio.Queue()
    wf = two_ranks(failed)
    rank0 = await wf.supervisor.spawn("train.0", SLEEPER)
    rank1 = await wf.supervisor.spawn("train.1", SLEEPER)
    survivor = WorkerInfo("w1", "train.1.0", "train", "node0", rank1.pid, capacity=1)
    try:
        # Rank 0 dies, and rank 1's failed collective is reported before the controller has
        # handled rank 0's exit: nothing below yields to the loop, so its watcher cannot run.
        rank0.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # the loop's child watcher reaped it
            # dead, not reaped here; blocking on purpose
            os.waitid(os.P_PID, rank0.pid, os.WEXITED | os.WNOWAIT)  # noqa: ASYNC222
        wf.group_down(survivor.name, "failed a micro-batch of step 3: Connection reset")
        error = failed.get_nowait()
        assert "rank train.0 went down (its process exited; rank train.1.0 then failed" in error
        assert "max_restarts is 0" in error

        # With every rank alive, the rank that failed is the one named.
        await wf.supervisor.stop_all(0.0, only=lambda c: c.name == "train.0",
                                     signals=(signal.SIGKILL,))
        again = await wf.supervisor.spawn("train.0", SLEEPER)
        assert not wf.supervisor.exited(again.pid)
        wf.group_down(survivor.name, "failed a micro-batch of step 4: out of memory")
        assert "rank train.1.0 went down (failed a micro-batch of step 4" in failed.get_nowait()
    finally:
        await wf.supervisor.stop_all(0.0, signals=(signal.SIGKILL,))


@pytest.mark.timeout(90)
async def test_a_rank_that_dies_before_registering_takes_the_group_down() -> None:
    # Real worker processes given endpoints no socket accepts: each exits before registering.
    failed: asyncio.Queue[str] = asyncio.Queue()
    wf = two_ranks(failed)
    wf.endpoints.controller = wf.endpoints.broadcast = wf.endpoints.store = "nowhere://x"
    try:
        await wf.start_pools()
        while "data-parallel trainer rank" not in (error := await failed.get()):
            pass  # the other pools' workers die too, and fail the run their own way
        assert "before it registered" in error
        assert "max_restarts is 0" in error
    finally:
        await wf.supervisor.stop_all(0.0, signals=(signal.SIGKILL,))
        remove_run_dir(wf.run_id)  # the workers' spec files (a controller's close removes it)
