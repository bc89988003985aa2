"""A node agent lost mid-run (killed, or stopped for longer than ``node_timeout_s``) takes its
workers and its store's data with it; the run goes on without the node
(`flowrl.control.lost_nodes`).

Real controller, the controller's own node agent and one on node ``a`` over tcp+curve, and
worker processes on the simulated engine: half the rollout workers on each node.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from flowrl.controller import Controller
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from tests.test_multinode import FAST, agents_reaped, start_joined, wait_exit
from transport.curve import CurveKeys
from transport.handles import handle_node

ROLLOUT = 6


def spec(rollout_nodes: tuple[str, ...], *, node_dispatch: bool = False) -> PipelineSpec:
    """Half the rollout workers on each node; with ``node_dispatch``, a reward worker on each
    node too, node a's workers dispatched by its agent under leases."""
    reward = (PoolSpec("reward", count=2, per_process=1, nodes=("node0", "a")) if node_dispatch
              else PoolSpec("reward", count=1))
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=ROLLOUT, per_process=ROLLOUT // len(rollout_nodes),
                        nodes=rollout_nodes),
               reward, PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=1,
        engine="sim", engine_config={**FAST, "reward_token_s": 0.002 if node_dispatch else 0.0},
        store_capacity_bytes=32 << 20, heartbeat_s=0.5, heartbeat_timeout_s=10.0,
        node_dispatch=node_dispatch,
    )


def on_a(ctl: Controller) -> list[int]:
    """Live groups with a row whose data is on node a's store."""
    return ctl.index.groups_holding(lambda h: handle_node(h) == "a")


def idle_on_a(ctl: Controller) -> list[int]:
    return [g for g in on_a(ctl) if not ctl.index.group_in_flight(g)]


def state(ctl: Controller) -> str:
    """What a failed wait says about the run."""
    return (f"version {ctl.version}, paused {ctl.paused}, in flight "
            f"{sorted(a.task.stage for a in ctl.assignments)}, groups on a {on_a(ctl)}, "
            f"errors {ctl.errors}")


async def drained_with_data_on_a(ctl: Controller, running: asyncio.Future[Any]) -> None:
    """Pause as soon as node a holds data (re-checked after every task: whether a step's
    groups went there depends on how fast node a's workers served the new weights) until the
    drained run has some of it waiting, unread."""
    while not running.done():
        await ctl.wait_for(lambda: bool(on_a(ctl)) or running.done())
        ctl.pause()
        await ctl.wait_for(lambda: not ctl.assignments)
        if idle_on_a(ctl):
            return
        ctl.resume()
        await next_task(ctl, running)
    await running  # the run's own error, if it failed
    pytest.fail(f"the run ended before a drained state with node a's data came up: "
                f"{state(ctl)}")


async def next_task(ctl: Controller, running: asyncio.Future[Any]) -> None:
    """Until one more task ended (or the run did)."""
    def done() -> int:
        return sum(w.done + w.failed for w in ctl.registry.all())
    before = done()
    await ctl.wait_for(lambda: done() > before or running.done())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "stopped"])
async def test_a_lost_node_is_left_behind_its_lost_groups_redone_and_no_row_trained_twice(
        tmp_path: Path, how: str) -> None:
    keys = CurveKeys.generate()
    ctl = Controller(spec(("node0", "a")), cluster=ClusterConfig(keys=keys, node_timeout_s=3.0),
                     start_timeout_s=60)
    assert ctl.nodes is not None
    log = tmp_path / "a.log"
    procs: list[asyncio.subprocess.Process] = []
    family: list[psutil.Process] = []
    async with agents_reaped(procs):
        try:
            await start_joined(ctl, "a", log, keys, procs)
            agent = psutil.Process(procs[0].pid)
            family = agent.children(recursive=True)
            assert family  # its worker process
            running = asyncio.ensure_future(ctl.run(steps=8, timeout_s=150))
            # Drained, with node a's data waiting in the index and no task reading it: what
            # is dropped at the loss is then known exactly.
            try:
                async with asyncio.timeout(100):
                    await drained_with_data_on_a(ctl, running)
            except TimeoutError:
                pytest.fail(f"no drained state came up in 100 s: {state(ctl)}")
            held, idle = on_a(ctl), idle_on_a(ctl)
            assert idle, f"no drained state with node a's data waiting came up: {state(ctl)}"
            # The loss below must be the kill's: a node declared lost before it (its agent
            # silent for `node_timeout_s`) took tasks in flight with it, so what is dropped at
            # the loss is not known.
            assert not ctl.lost_nodes.nodes, f"node a was lost before it was killed: {state(ctl)}"
            if how == "killed":
                agent.send_signal(signal.SIGKILL)
            else:
                agent.suspend()  # and its workers: a whole node frozen
                for p in family:
                    p.suspend()
            async with asyncio.timeout(30):
                await ctl.wait_for(lambda: ctl.lost_nodes.nodes == ["a"])
            # Waiting groups were dropped at once; held ones (a trained micro-batch of the
            # step in progress) wait for their step.
            assert ctl.lost_nodes.groups_dropped == len(idle) >= 1, (
                f"dropped {ctl.lost_nodes.groups_dropped} of idle {idle} (held {held}); "
                f"{state(ctl)}")
            assert ctl.lost_nodes.waiting == len(held) - len(idle)
            assert not [w for w in ctl.registry.all() if w.node == "a"]
            assert ctl.status()["nodes_lost"] == ["a"]
            if how == "stopped":
                for p in [agent, *family]:
                    p.resume()  # it wakes up to a refusal and leaves, with its workers
                assert await wait_exit(procs[0], log) != 0
                assert "declared lost" in log.read_text()
            ctl.resume()
            out = await running
            assert out["version"] == ctl.version == 8
            assert out["rows_trained_twice"] == 0
            ctl.index.audit()  # the index's books balance (raises if not)
            # Nothing of node a is left: every group with data there was trained or dropped.
            assert not on_a(ctl)
            assert ctl.lost_nodes.waiting == 0
            assert ctl.status()["groups_lost"] == len(idle)
            # The workers left were enough: node0's rollout workers made every later step.
            assert {w.node for w in ctl.registry.of_role("rollout")} == {"node0"}
        finally:
            # A stopped worker would not act on its agent's death (nor on being reaped) until
            # continued: after a failure above, it would be left behind, stopped.
            for p in family:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
            await ctl.aclose()
        if how == "killed":
            await wait_exit(procs[0], log)
    # Its workers die with it (parent-death signal): none is left.
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive


@pytest.mark.timeout(180)
async def test_a_lost_dispatching_node_gives_its_leases_back_and_no_row_is_trained_twice(
        tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    ctl = Controller(spec(("node0", "a"), node_dispatch=True),
                     cluster=ClusterConfig(keys=keys, node_timeout_s=3.0), start_timeout_s=60)
    assert ctl.nodes is not None
    leases = ctl.node_leases
    assert leases is not None
    log = tmp_path / "a.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            await start_joined(ctl, "a", log, keys, procs)
            family = psutil.Process(procs[0].pid).children(recursive=True)
            running = asyncio.ensure_future(ctl.run(steps=8, timeout_s=150))
            # Killed while it holds leases, rollout's among them (its agent dispatches both
            # roles), not drained: tasks in flight there come back.
            granted = asyncio.Event()
            leases.on_grant.append(granted.set)
            while not {x.stage for x in leases.leases.of_node("a") if x.open} >= {"rollout"}:
                granted.clear()
                await granted.wait()
            procs[0].send_signal(signal.SIGKILL)
            async with asyncio.timeout(30):
                await ctl.wait_for(lambda: ctl.lost_nodes.nodes == ["a"])
            assert leases.leases.leased("a") == 0
            assert leases.lost_back >= 1  # what it held when it died came back
            await running
            out = await ctl.run(steps=3, timeout_s=60)  # all of it without node a
            assert out["version"] == ctl.version >= 11
            assert out["rows_trained_twice"] == 0
            ctl.index.audit()
            assert not on_a(ctl)
            assert {w.node for w in ctl.registry.of_role("reward")} == {"node0"}
        finally:
            await ctl.aclose()
        await wait_exit(procs[0], log)
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive
