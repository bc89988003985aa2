"""Node-local dispatch in real runs (``PipelineSpec.node_dispatch``): the controller leases reward
tasks to the agents of nodes ``a`` and ``b`` (separate processes, each with its own store), whose
reward workers poll their agent; train stays on the controller's node, dispatched centrally, and
rollout too unless a rollout worker runs on ``a`` and ``b`` (`SPREAD`), whose agents then take
rollout tasks formed ahead and hold each until its worker serves the version it needs. A seeded
run trains exactly the rows central dispatch trains, also when a leased worker is killed
mid-task or leases expire under live agents; a pause and a lowered staleness bound take back
the rollout tasks held for the next version."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flowrl.control.assignments import Assignments
from flowrl.control.node_leases import NodeLeases, dispatching_nodes
from flowrl.controller import Controller
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index
from flowrl.node_dispatch import OP_LEASE_JOIN, OP_LEASE_POLL, OP_LEASE_REPORT, Reports
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.registry import Registry
from tests.test_multinode import FAST, agents_reaped, start_agent, tail, wait_exit
from tests.test_scheduler import run as scheduler_run
from transport.curve import CurveKeys

STEPS = 3


#: rollout on every node, one worker each: the agents of a and b dispatch their rollout tasks
SPREAD = ("node0", "a", "b")


def spec(*, node_dispatch: bool, reward_token_s: float = 0.0,
         rollout_nodes: tuple[str, ...] = ()) -> PipelineSpec:
    rollout = (PoolSpec("rollout", count=3, nodes=rollout_nodes) if rollout_nodes
               else PoolSpec("rollout", count=2, per_process=2))
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(
            rollout,
            PoolSpec("reward", count=2, nodes=("a", "b")),
            PoolSpec("train", count=1),
        ),
        group_size=4, groups_per_step=4, max_staleness=1, seed=7,
        engine="sim", engine_config={**FAST, "reward_token_s": reward_token_s},
        store_capacity_bytes=32 << 20, heartbeat_s=0.5, heartbeat_timeout_s=10.0,
        node_dispatch=node_dispatch, restart_backoff_s=0.1,
    )


async def run(tmp_path: Path, s: PipelineSpec, chaos: Any = None) -> tuple[dict[str, Any],
                                                                           Controller]:
    keys = CurveKeys.generate()
    ctl = Controller(s, cluster=ClusterConfig(keys=keys), start_timeout_s=60)
    assert ctl.nodes is not None
    procs: list[asyncio.subprocess.Process] = []
    logs = {n: tmp_path / f"{n}-{s.node_dispatch}.log" for n in "ab"}
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            endpoint = await ctl.nodes.wait_listening()
            for n in "ab":
                procs.append(await start_agent(endpoint, n, logs[n], env=keys.to_env()))
            await starting
            running = asyncio.ensure_future(ctl.run(steps=STEPS, timeout_s=90))
            if chaos is not None:
                await chaos(ctl)
            out = await running
            out["status"] = ctl.status()
        finally:
            await ctl.aclose()
        codes = [await wait_exit(p, logs[n]) for p, n in zip(procs, "ab", strict=True)]
    assert codes == [0, 0], [tail(x) for x in logs.values()]
    return out, ctl


def accounting(out: dict[str, Any], ctl: Controller) -> tuple[int, int, int, int]:
    return out["version"], out["samples"], ctl.rows_trained, ctl.rows_trained_twice


async def granted(ctl: Controller, tasks: int, holds: str | None = None) -> None:
    """Until ``tasks`` more tasks were leased, and node ``holds`` (if named) holds some open (the
    leases' own event, no sleep)."""
    leases = ctl.node_leases
    assert leases is not None
    target = leases.tasks_leased + tasks
    event = asyncio.Event()
    leases.on_grant.append(event.set)
    try:
        while leases.tasks_leased < target or (holds is not None
                                               and not leases.leases.leased(holds)):
            event.clear()
            await event.wait()
    finally:
        leases.on_grant.remove(event.set)


async def reported(ctl: Controller, holds: Callable[[dict[str, int]], bool]) -> None:
    """Until, after an agent's report, ``holds`` is true of each node's open leased tasks (the
    leases' own event, no sleep)."""
    leases = ctl.node_leases
    assert leases is not None
    event = asyncio.Event()
    leases.on_report.append(event.set)

    def open_tasks() -> dict[str, int]:
        return {n: sum(len(x.open) for x in leases.leases.of_node(n)) for n in ("a", "b")}

    try:
        while True:
            event.clear()
            await event.wait()
            if holds(open_tasks()):
                return
    finally:
        leases.on_report.remove(event.set)


@pytest.mark.timeout(240)
async def test_node_dispatch_trains_the_rows_central_dispatch_trains(tmp_path: Path) -> None:
    central, ctl0 = await run(tmp_path, spec(node_dispatch=False))
    leased, ctl1 = await run(tmp_path, spec(node_dispatch=True))
    assert ctl0.node_leases is None
    assert accounting(leased, ctl1) == accounting(central, ctl0)
    assert accounting(leased, ctl1) == (STEPS, STEPS * 4 * 4, STEPS * 4 * 4, 0)
    leases = ctl1.node_leases
    assert leases is not None
    assert leases.tasks_leased >= STEPS * 4  # every reward task went through a lease
    assert leases.refused == 0, leases.statistics()
    assert {w["node"] for w in leased["status"]["workers"] if w["role"] == "reward"} == {"a", "b"}
    assert leased["status"]["worker_deaths"] == 0


@pytest.mark.timeout(240)
async def test_a_leased_worker_killed_mid_task_loses_no_row(tmp_path: Path) -> None:
    killed: list[int] = []

    async def kill_one(ctl: Controller) -> None:
        await granted(ctl, 4, holds="a")
        # Killed before its agent had a grant, the worker would hold nothing to give back. Its
        # agent reports a completion while the worker runs the task it took next (it holds 2:
        # capacity 1 + prefetch 1); node a holding 2 open tasks after a report (the next grant
        # fills the slot just freed) means the worker holds one (tasks of ~0.4 s).
        await reported(ctl, lambda open_tasks: open_tasks["a"] >= 2)
        reward = [w for w in ctl.registry.all() if w.role == "reward" and w.node == "a"]
        killed.append(reward[0].pid)
        os.kill(reward[0].pid, signal.SIGKILL)  # one machine: node a's process is ours to kill

    out, ctl = await run(tmp_path, spec(node_dispatch=True, reward_token_s=0.005), kill_one)
    assert killed
    assert accounting(out, ctl) == (STEPS, STEPS * 4 * 4, STEPS * 4 * 4, 0)
    assert out["status"]["worker_deaths"] >= 1
    assert out["status"]["restarts"] >= 1
    leases = ctl.node_leases
    assert leases is not None
    # The killed worker's task came back: given back by its agent, or with its lease.
    assert leases.given_back + leases.expired >= 1


@pytest.mark.timeout(240)
async def test_leases_expiring_under_live_agents_lose_no_row(tmp_path: Path) -> None:
    expired: list[int] = []

    async def expire(ctl: Controller) -> None:
        leases = ctl.node_leases
        assert leases is not None
        for _ in range(3):
            await granted(ctl, 2)
            # As if the agents had not renewed: every lease is taken back under them.
            expired.append(leases.expire(math.inf))

    out, ctl = await run(tmp_path, spec(node_dispatch=True, reward_token_s=0.0005), expire)
    assert sum(expired) > 0
    assert ctl.node_leases is not None
    assert ctl.node_leases.expired >= sum(expired)
    assert accounting(out, ctl) == (STEPS, STEPS * 4 * 4, STEPS * 4 * 4, 0)
    assert out["status"]["worker_deaths"] == 0


async def leased_ahead(ctl: Controller) -> None:
    """Until an agent holds rollout tasks that no worker may run before the trainer's next
    version (the leases' own event, no sleep)."""
    leases = ctl.node_leases
    assert leases is not None

    def ahead() -> bool:
        return any(x.stage == "rollout" and x.need > ctl.version
                   for n in ("a", "b") for x in leases.leases.of_node(n))

    event = asyncio.Event()
    leases.on_grant.append(event.set)
    try:
        while not ahead():
            event.clear()
            await event.wait()
    finally:
        leases.on_grant.remove(event.set)


def rollout_done(out: dict[str, Any]) -> dict[str, int]:
    """Rollout tasks each node's workers ran."""
    done: dict[str, int] = {}
    for w in out["status"]["workers"]:
        if w["role"] == "rollout":
            done[w["node"]] = done.get(w["node"], 0) + w["done"]
    return done


@pytest.mark.timeout(240)
async def test_rollout_leased_to_agents_trains_the_rows_central_dispatch_trains(
        tmp_path: Path) -> None:
    central, ctl0 = await run(tmp_path, spec(node_dispatch=False, rollout_nodes=SPREAD))
    leased, ctl1 = await run(tmp_path, spec(node_dispatch=True, rollout_nodes=SPREAD))
    assert accounting(leased, ctl1) == accounting(central, ctl0)
    assert accounting(leased, ctl1) == (STEPS, STEPS * 4 * 4, STEPS * 4 * 4, 0)
    leases = ctl1.node_leases
    assert leases is not None
    assert leases.rollout_leased > 0
    assert leases.refused == 0, leases.statistics()
    # The agents' workers generated, each under a version its lease allowed. (Not "no group
    # dropped as stale": on busy cores a group generated in time may still be trained a step
    # late, as with central dispatch, and then the gate drops it.)
    assert set(rollout_done(leased)) == {"node0", "a", "b"}, rollout_done(leased)
    assert leases.below_need == 0, leases.statistics()
    assert set(leased["staleness"]) <= {0, 1}
    # status says it too: each node's agent and what it holds by stage (the next step's
    # rollout, admitted as the run ended, may be there), and the counts
    shown = leased["status"]["leases"]
    assert shown["rollout_leased"] == leases.rollout_leased
    assert {n: sorted(x["held"]) for n, x in shown["nodes"].items()} == {
        n: ["reward", "rollout"] for n in "ab"}
    assert all(x["epoch"] >= 1 for x in shown["nodes"].values())  # joined (maybe again)
    assert central["status"]["leases"] is None


@pytest.mark.timeout(240)
async def test_a_pause_takes_back_rollout_leased_ahead_and_a_lowered_bound_too(
        tmp_path: Path) -> None:
    seen: dict[str, int] = {}

    async def pause_then_lower(ctl: Controller) -> None:
        leases = ctl.node_leases
        assert leases is not None
        await leased_ahead(ctl)
        ctl.pause()  # what the agents hold for the next version would never drain
        seen["paused_recalled"] = leases.recalled
        async with asyncio.timeout(60):
            await ctl.wait_for(lambda: not ctl.assignments)
        ctl.resume()
        await leased_ahead(ctl)
        before = leases.recalled
        ctl.set_max_staleness(0)  # tasks for the next version hold groups beyond the gate
        seen["lowered_recalled"] = leases.recalled - before

    out, ctl = await run(tmp_path, spec(node_dispatch=True, rollout_nodes=SPREAD),
                         pause_then_lower)
    assert seen["paused_recalled"] > 0, seen
    assert seen["lowered_recalled"] > 0, seen
    assert accounting(out, ctl) == (STEPS, STEPS * 4 * 4, STEPS * 4 * 4, 0)
    assert set(out["staleness"]) <= {0, 1}
    assert ctl.node_leases is not None
    assert ctl.node_leases.refused == 0


def test_node_dispatch_needs_leased_workers_on_another_node() -> None:
    s = spec(node_dispatch=True)
    assert dispatching_nodes(s, "node0") == {"a", "b"}
    local = dataclasses.replace(s, pools=tuple(dataclasses.replace(p, nodes=())
                                               for p in s.pools))
    with pytest.raises(ValueError, match="node other than the controller's"):
        Controller(local)


# ---- the controller's wiring alone (no process): a real index and registry -------------------

def wiring(ready_groups: int) -> tuple[Any, Index, Registry, list[Any], list[int]]:
    g = StageGraph([StageSpec("rollout", ("prompt",), ("response",), group_level=True),
                    StageSpec("reward", ("response",), ("reward",), micro_batch=2)],
                   source_fields=("prompt",))
    ix = Index(g)
    for n in range(ready_groups):
        ix.add_group(2, fields={"prompt": [n, n]})
        t = ix.request("rollout", 1)
        assert t is not None
        ix.complete(t.id, {"response": [10 * n, 10 * n + 1]})
    reg = Registry(10.0, tasks_per_slot=2)
    reported: list[Any] = []
    back: list[int] = []
    leases = NodeLeases(g, ix, reg, Assignments(), nodes={"a"},
                        reported=lambda a, r: reported.append((a.worker, r.task_id)),
                        failed=lambda a, e: reported.append(("failed", e)),
                        give_back=lambda tid: (back.append(tid), ix.fail(tid)),
                        wake=lambda: None, now=lambda: 0.0)
    return leases, ix, reg, reported, back


async def call(leases: NodeLeases, op: str, **p: Any) -> Any:
    return await leases.handlers()[op](p, b"")


async def test_a_dispatching_nodes_workers_get_leases_up_to_their_room() -> None:
    leases, _, reg, reported, back = wiring(ready_groups=4)  # 4 reward tasks ready
    here = reg.register(name="reward.0.0", role="reward", node="node0", pid=1, capacity=1,
                        version=0, now=0.0)
    there = reg.register(name="reward.1.0", role="reward", node="a", pid=2, capacity=1,
                         version=0, now=0.0)
    for w in (here, there):
        leases.registered(w)
    assert reg.least_loaded("reward") is here  # the agent's worker is never picked here
    joined = await call(leases, OP_LEASE_JOIN, node="a")
    assert joined["stages"] == {"reward": "reward"}
    leases.dispatch(0.0)
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=joined["epoch"], wait_s=0.0)
    assert [c["worker_id"] for c in cmds["admit"]] == [there.worker_id]
    (grant,) = cmds["grant"]
    assert len(grant["tasks"]) == 2  # capacity 1 x 2 tasks per slot
    t0, t1 = grant["tasks"]
    done = {"worker_id": there.worker_id, "task_id": t0["task_id"],
            "fields": {"reward": [1.0, 2.0]}, "lengths": [], "version": None, "metrics": {}}
    wire = Reports(joined["epoch"], done=[(grant["lease"], t0["rows"], done)],  # type: ignore[list-item]
                   held=[grant["lease"]]).to_wire()
    assert await call(leases, OP_LEASE_REPORT, node="a", **wire) == {"revoked": []}
    assert await call(leases, OP_LEASE_REPORT, node="a", **wire) == {"revoked": []}
    assert reported == [(there.worker_id, t0["task_id"])]  # once: the repeat is refused
    assert leases.refused == 1
    # Not renewed in time: the open task comes back, its lease is revoked at the agent.
    assert leases.expire(math.inf) == 1
    assert back == [t1["task_id"]]
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=joined["epoch"], wait_s=0.0)
    assert cmds["revoke"] == [grant["lease"]]
    # The worker leaves: its agent forgets it, and the node has no room left.
    reg.remove(there.worker_id)
    leases.gone(there)
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=joined["epoch"], wait_s=0.0)
    assert cmds["forget"] == [there.worker_id]
    leases.dispatch(0.0)
    assert leases.granted == 1


async def rollout_leases(groups_per_step: int, nodes: tuple[str, ...], *,
                         agents: str = "ab") -> tuple[Any, NodeLeases, dict[str, int]]:
    """A scheduler at staleness 0 whose rollout node agents ``agents`` dispatch (joined: their
    epochs), with 4 idle rollout workers of 1 task slot on each of ``nodes``."""
    r = scheduler_run(staleness=0, groups_per_step=groups_per_step, micro_groups=1)
    s = r.scheduler
    leases = NodeLeases(s.graph, s.index, r.registry, s.assignments, nodes=set(agents),
                        reported=lambda a, rep: None, failed=lambda a, e: None,
                        give_back=s.fail_task, wake=lambda: None, now=lambda: 0.0,
                        scheduler=s)
    for node in nodes:
        for i in range(4):
            leases.registered(r.registry.register(
                name=f"rollout.{node}.{i}", role="rollout", node=node, pid=i + 1, capacity=1,
                version=0, now=0.0))
    epochs = {n: (await call(leases, OP_LEASE_JOIN, node=n))["epoch"] for n in agents}
    return r, leases, epochs


async def test_rollout_tasks_are_split_over_the_nodes_and_this_one_by_room() -> None:
    """A step's rollout tasks, formed ahead, are spread by room over the agents and the
    controller's own node, whose idle workers do not take them all first; each agent's share
    says the version it needs."""
    r, leases, epochs = await rollout_leases(6, ("node0", "a", "b"))
    s = r.scheduler
    s.dispatch(steps_target=1, now=0.0)  # forms nothing itself: admission is ahead of it
    assert s.may_admit_ahead
    assert s.admit_ahead(steps_target=1, now=0.0, up_to=100) == 6
    s.dispatch(steps_target=1, now=0.0)
    leases.dispatch(0.0)  # as the controller's pass does after the scheduler's
    assert len(r.sent) == 2  # 6 tasks over rooms of 4, 4 and 4: 2 each
    for n in "ab":
        cmds = await call(leases, OP_LEASE_POLL, node=n, epoch=epochs[n], wait_s=0.0)
        assert [(len(g["tasks"]), g["needs"]) for g in cmds["grant"]] == [(2, [0, 0])]
    assert leases.rollout_leased == 4
    assert s.formed_waiting() == 0


async def test_rollout_leased_for_the_next_version_is_recalled_and_leased_again() -> None:
    """Tasks leased for a version the trainer has not reached are taken back whole (a pause),
    their groups wait first in the queue, and the next pass leases them again, needing the
    same version; the tasks a worker may run now stay with the agent."""
    r, leases, epochs = await rollout_leases(2, ("a",), agents="a")
    s = r.scheduler
    s.dispatch(steps_target=0, now=0.0)
    assert s.admit_ahead(steps_target=0, now=0.0, up_to=100) == 4  # step 0, and step 1 ahead
    leases.dispatch(0.0)
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=epochs["a"], wait_s=0.0)
    assert [g["needs"] for g in cmds["grant"]] == [[0, 0], [1, 1]]
    ahead = cmds["grant"][1]["lease"]
    assert s.recall_leased() == 2
    assert leases.leases.held("a", "rollout") == 2  # step 0's stay
    assert not any(a.task.id in {t["task_id"] for t in cmds["grant"][1]["tasks"]}
                   for a in s.assignments)
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=epochs["a"], wait_s=0.0)
    assert cmds["revoke"] == [ahead]
    assert s.recall_leased() == 0  # nothing ahead is leased any more
    s.dispatch(steps_target=0, now=0.0)
    leases.dispatch(0.0)
    cmds = await call(leases, OP_LEASE_POLL, node="a", epoch=epochs["a"], wait_s=0.0)
    assert [(g["needs"], [r.admission.step_of(gid) for t in g["tasks"]
                          for gid in s.index.task(t["task_id"]).groups])
            for g in cmds["grant"]] == [([1, 1], [1, 1])]
