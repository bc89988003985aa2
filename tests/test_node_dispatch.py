"""A node agent's local dispatch (`flowrl.node_dispatch`) with the controller's lease table
(`flowrl.control.leases`) and a real `Index`: unit checks of the agent side; seeded runs of
several agents and their workers (coroutines), where workers fail tasks and an agent dies
mid-run, its late reports arriving after the controller took its leases back, or every lease
expires while the agents live on; then real `Worker`s polling the agent over real sockets, one
of them stopped mid-run. Every row must be scored exactly once, with the values central
dispatch gives.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from flowrl import messages as m
from flowrl.control.leases import Leases, Verdict, split
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.node_dispatch import DispatchApi, LocalDispatch, MalformedLease, Reports
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir, run_dir
from transport.errors import TransportError
from transport.pubsub import Publisher
from transport.rpc import RpcClient, RpcServer
from transport.store_client import StoreClient
from workers.runtime import RoleOutput, Worker, WorkerConfig

pytestmark = pytest.mark.timeout(60)

STAGE = "reward"
MICRO_BATCH = 3


def graph() -> StageGraph:
    return StageGraph([StageSpec(STAGE, ("response",), ("reward",), micro_batch=MICRO_BATCH)],
                      source_fields=("response",))


def task_msg(t: Task) -> m.TaskMsg:
    return {"task_id": t.id, "stage": t.stage, "rows": list(t.rows), "groups": list(t.groups),
            "row_groups": [], "inputs": {k: list(v) for k, v in t.handles.items()},
            "params": {}}


def done_msg(worker: str, msg: m.TaskMsg) -> m.DoneMsg:
    return {"worker_id": worker, "task_id": msg["task_id"],
            "fields": {"reward": [score(h) for h in msg["inputs"]["response"]]},
            "lengths": [], "version": None, "metrics": {}}


def score(response: int) -> float:
    return (response * 7919 % 101) / 100.0


def grant(lease: int, epoch: int, *msgs: m.TaskMsg) -> dict[str, object]:
    return {"lease": lease, "epoch": epoch, "stage": STAGE, "tasks": list(msgs)}


def tasks(n: int) -> list[m.TaskMsg]:
    """``n`` tasks of the stage, from one group of ``n`` micro-batches."""
    ix = Index(graph())
    ix.add_group(MICRO_BATCH * n, fields={"response": list(range(MICRO_BATCH * n))})
    out = [ix.request(STAGE) for _ in range(n)]
    assert all(t is not None for t in out)
    return [task_msg(t) for t in out if t is not None]


# ---- the agent side ------------------------------------------------------------------------

async def test_a_poll_waits_for_a_lease_and_each_task_goes_to_one_worker() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    polls = [asyncio.create_task(agent.take(w, STAGE, 5.0)) for w in ("w1", "w2", "w3")]
    await asyncio.sleep(0)  # the polls start waiting (a lease queued first is taken as well)
    m1, m2 = tasks(2)
    assert agent.add_lease(grant(7, 1, m1, m2)) == 2
    got = await asyncio.gather(*polls[:2])
    assert sorted(t["task_id"] for t in got if t is not None) == [m1["task_id"], m2["task_id"]]
    assert agent.queued() == 0
    assert agent.running() == 2
    polls[2].cancel()
    assert await agent.take("w3", STAGE, 0.01) is None


async def test_a_grant_wakes_only_as_many_polls_as_it_has_tasks_oldest_first() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    expired = await agent.take("w0", STAGE, 0.0)  # waits behind no one, and expires
    assert expired is None
    polls = {w: asyncio.create_task(agent.take(w, STAGE, 30.0)) for w in ("w1", "w2", "w3", "w4")}
    await asyncio.sleep(0)  # each poll waits, in this order
    assert agent.worker_gone("w2") == []  # its poll ends with nothing, and takes nothing
    await asyncio.sleep(0)
    assert polls["w2"].done()
    assert polls["w2"].result() is None
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 1, m1))
    assert await polls["w1"] == m1
    await asyncio.sleep(0)
    assert not polls["w3"].done()  # not woken by a task not theirs
    assert not polls["w4"].done()
    agent.add_lease(grant(8, 1, m2))
    assert await polls["w3"] == m2
    await asyncio.sleep(0)
    assert not polls["w4"].done()
    polls["w4"].cancel()
    assert agent.running() == 2


async def test_a_poll_cancelled_after_it_was_handed_a_task_puts_the_task_back_first() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    poll = asyncio.create_task(agent.take("w1", STAGE, 30.0))
    await asyncio.sleep(0)
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 1, m1, m2))  # m1 to the waiting poll, m2 queued
    poll.cancel()  # before the poll's coroutine resumes with m1 (its server closed)
    with pytest.raises(asyncio.CancelledError):
        await poll
    assert agent.running() == 0
    assert agent.queued(STAGE) == 2
    assert await agent.take("w2", STAGE, 1.0) == m1  # back at the head of the queue
    assert not agent.done("w1", done_msg("w1", m1))  # w1 never held it


async def test_a_report_counts_once_and_only_from_the_worker_holding_the_task() -> None:
    agent = LocalDispatch("a")
    agent.joined(3)
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 3, m1, m2))
    t = await agent.take("w1", STAGE, 1.0)
    assert t == m1
    assert not agent.done("w2", done_msg("w2", m1))  # not its task
    assert agent.done("w1", done_msg("w1", m1))
    assert not agent.done("w1", done_msg("w1", m1))  # a repeat
    assert not agent.failed("w1", m1["task_id"])
    out = agent.take_reports()
    assert out.epoch == 3
    assert [(lease, rows, d["task_id"]) for lease, rows, d in out.done] == [
        (7, m1["rows"], m1["task_id"])]
    assert out.held == [7]  # m2 still queued: renew
    assert not agent.take_reports()


async def test_failed_tasks_and_a_dead_workers_tasks_go_back_to_the_controller() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 1, m1, m2))
    await agent.take("w1", STAGE, 1.0)
    await agent.take("w2", STAGE, 1.0)
    assert agent.failed("w1", m1["task_id"])
    assert agent.worker_gone("w2") == [m2["task_id"]]
    assert agent.take_reports().given_back == [(7, m1["task_id"]), (7, m2["task_id"])]
    assert agent.running() == 0


async def test_a_stopping_agent_gives_back_what_it_queued() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 1, m1, m2))
    await agent.take("w1", STAGE, 1.0)
    assert agent.abandon() == [m2["task_id"]]
    out = agent.take_reports()
    assert out.given_back == [(7, m2["task_id"])]
    assert out.held == [7]  # m1 runs on


async def test_a_revoked_lease_is_forgotten_queued_or_running() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    m1, m2 = tasks(2)
    agent.add_lease(grant(7, 1, m1, m2))
    await agent.take("w1", STAGE, 1.0)
    assert sorted(agent.revoked(7)) == sorted([m1["task_id"], m2["task_id"]])
    assert agent.queued() == 0
    assert agent.running() == 0
    assert not agent.done("w1", done_msg("w1", m1))  # the controller has its rows again
    assert not agent.take_reports()
    assert agent.revoked(7) == []


async def test_a_grant_to_an_earlier_epoch_is_ignored_and_a_malformed_one_refused() -> None:
    agent = LocalDispatch("a")
    agent.joined(2)
    m1, m2 = tasks(2)
    assert agent.add_lease(grant(7, 1, m1)) == 0
    for bad in (None, {"lease": 1, "epoch": 2, "stage": STAGE, "tasks": []},
                {"lease": "1", "epoch": 2, "stage": STAGE, "tasks": [m1]},
                grant(8, 2, {**m1, "stage": "train"})):  # type: ignore[typeddict-item]
        with pytest.raises(MalformedLease):
            agent.add_lease(bad)
    agent.add_lease(grant(8, 2, m1))
    with pytest.raises(MalformedLease, match="held here already"):
        agent.add_lease(grant(9, 2, m1, m2))
    assert agent.queued(STAGE) == 1
    # Rejoined under a new epoch: the controller took everything back; so does the agent.
    agent.joined(3)
    assert agent.queued() == 0
    assert agent.take_reports().held == []


def versioned(lease: int, epoch: int, *needed: tuple[m.TaskMsg, int]) -> dict[str, object]:
    """A grant of tasks that each need a policy version (rollout tasks formed ahead)."""
    return {**grant(lease, epoch, *(msg for msg, _ in needed)), "needs": [v for _, v in needed]}


async def test_a_task_that_needs_a_version_goes_only_to_a_worker_serving_it() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    agent.serving("old", 1)
    agent.serving("new", 2)
    m1, m2, m3, m4, m5, m6 = tasks(6)
    old = asyncio.create_task(agent.take("old", STAGE, 30.0))
    new = asyncio.create_task(agent.take("new", STAGE, 30.0))
    await asyncio.sleep(0)  # both wait, "old" first
    agent.add_lease(versioned(7, 1, (m1, 2)))
    assert await new == m1  # the older poll keeps its place: it may not run m1
    await asyncio.sleep(0)
    assert not old.done()
    agent.add_lease(versioned(8, 1, (m2, 1)))
    assert await old == m2
    # A queued task that needs a version later than the queue's next: taken past it.
    agent.add_lease(versioned(9, 1, (m3, 3), (m4, 1)))
    assert await agent.take("old", STAGE, 0.0) == m4
    assert await agent.take("new", STAGE, 0.0) is None  # m3 needs version 3
    assert agent.queued(STAGE) == 1
    # The poll of a worker waiting for its version gets the task once it serves it; a late
    # report of an older version changes nothing.
    poll = asyncio.create_task(agent.take("old", STAGE, 30.0))
    await asyncio.sleep(0)
    agent.serving("old", 3)
    assert await poll == m3
    agent.serving("old", 2)
    agent.add_lease(versioned(10, 1, (m5, 3)))
    assert await agent.take("old", STAGE, 0.0) == m5
    # A worker gone is forgotten with its version: one that comes back with that id (a new
    # process) starts at what it registers with.
    agent.worker_gone("old")
    agent.add_lease(versioned(11, 1, (m6, 3)))
    assert await agent.take("old", STAGE, 0.0) is None


async def test_a_grant_of_malformed_needs_is_refused_whole() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    m1, m2 = tasks(2)
    for needs in ([1], [1, -1], [1, "2"], {"a": 1}, [1, 2, 3]):
        with pytest.raises(MalformedLease, match="'needs'"):
            agent.add_lease({**grant(7, 1, m1, m2), "needs": needs})
    assert agent.queued() == 0


async def test_only_a_served_report_with_the_workers_token_moves_its_version() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    api = DispatchApi(agent)
    api.admit("w1", b"token-1", STAGE, version=2)
    (m1,) = tasks(1)
    agent.add_lease(versioned(7, 1, (m1, 3)))
    poll = asyncio.create_task(agent.take("w1", STAGE, 30.0))
    await asyncio.sleep(0)
    api.served("w1", b"token-2", 3)  # another's token
    api.served("w2", b"token-1", 3)  # not a worker of this node
    await asyncio.sleep(0)
    assert not poll.done()
    api.served("w1", b"token-1", 3)
    assert await poll == m1


# ---- runs: the controller's lease table, agents, workers -----------------------------------

@dataclass
class Controller:
    """What the controller does with leases: grant ready tasks to live agents within a budget
    per node, apply their reports (a completion reaches the index only when the lease table
    accepts it), and fail back what a dead agent held."""

    ix: Index
    leases: Leases
    budget: int
    lease_size: int
    now: float = 0.0
    scored: dict[int, float] = field(default_factory=dict)
    refused: list[Verdict] = field(default_factory=list)
    given_back: int = 0
    revoked: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def grant(self, agents: dict[str, LocalDispatch]) -> None:
        """Lease ready tasks to the agents, split by the room each has (`split`)."""
        ready = -(-self.ix.ready_units(STAGE) // MICRO_BATCH)
        room = {n: self.budget - self.leases.leased(n) for n in agents}
        for node, n in split(ready, room).items():
            epoch = self.leases.epoch(node)
            assert epoch is not None
            while n > 0:
                tasks = [t for _ in range(min(n, self.lease_size))
                         if (t := self.ix.request(STAGE)) is not None]
                if not tasks:
                    return
                n -= len(tasks)
                lease = self.leases.grant(node, epoch, STAGE, tasks, self.now)
                agents[node].add_lease({"lease": lease.id, "epoch": epoch, "stage": STAGE,
                                        "tasks": [task_msg(t) for t in tasks]})

    def apply(self, node: str, out: Reports) -> list[int]:
        """Take an agent's reports; the leases it holds that are not its any more."""
        for lease, rows, report in out.done:
            tid = report["task_id"]
            verdict = self.leases.complete(node, out.epoch, lease, tid, rows, self.now)
            if verdict is not Verdict.ACCEPTED:
                self.refused.append(verdict)
                continue
            values = report["fields"]["reward"]
            for r, v in zip(rows, values, strict=True):
                assert r not in self.scored, f"row {r} scored twice"
                self.scored[r] = v
            self.ix.complete(tid, {"reward": values})
        for lease, tid in out.given_back:
            verdict = self.leases.give_back(node, out.epoch, lease, tid, self.now)
            if verdict is Verdict.ACCEPTED:
                self.ix.fail(tid)
                self.given_back += 1
            else:
                self.refused.append(verdict)
        revoked = [lease for lease in out.held
                   if self.leases.renew(node, out.epoch, lease, self.now) is not Verdict.ACCEPTED]
        self.revoked += len(revoked)
        self.wake.set()
        return revoked

    def gone(self, node: str) -> None:
        for tid in self.leases.node_gone(node):
            self.ix.fail(tid)
        self.wake.set()


def new_index(groups: int, size: int) -> Index:
    ix = Index(graph())
    for g in range(groups):
        ix.add_group(size, fields={"response": [g * size + i for i in range(size)]})
    return ix


def central(groups: int, size: int) -> dict[int, float]:
    """What central dispatch scores: every task to one worker, reported."""
    ix = new_index(groups, size)
    out: dict[int, float] = {}
    while (t := ix.request(STAGE)) is not None:
        values = [score(h) for h in t.handles["response"]]
        out.update(zip(t.rows, values, strict=True))
        ix.complete(t.id, {"reward": values})
    assert ix.statistics().rows == 0
    return out


@dataclass
class Node:
    name: str
    agent: LocalDispatch
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


async def worker(agent: LocalDispatch, wid: str, rng: random.Random, fail_p: float) -> None:
    while True:
        msg = await agent.take(wid, STAGE, 1.0)
        if msg is None:
            continue
        await asyncio.sleep(0)  # the work
        if rng.random() < fail_p:
            agent.failed(wid, msg["task_id"])
        else:
            agent.done(wid, done_msg(wid, msg))


async def uplink(node: Node, ctl: Controller, late: list[Reports] | None) -> None:
    while True:
        out = await node.agent.reports(1.0)
        # An agent about to die holds a few reports back: they arrive after its death.
        if late is not None and len(late) < 3 and out.done:
            late.append(out)
            continue
        for lease in ctl.apply(node.name, out):
            node.agent.revoked(lease)


async def run(*, seed: int, nodes: int = 3, workers: int = 3, groups: int = 40,
              size: int = 4, fail_p: float = 0.1, kill_after: int | None = None,
              expire_after: int | None = None) -> Controller:
    rng = random.Random(seed)
    ctl = Controller(new_index(groups, size), Leases(ttl_s=10.0), budget=2 * workers,
                     lease_size=2)
    total = groups * size
    late: list[Reports] = []
    cluster: dict[str, Node] = {}

    def start(name: str, doomed: bool = False) -> None:
        node = Node(name, LocalDispatch(name))
        epoch, back = ctl.leases.join(name)
        assert back == []
        node.agent.joined(epoch)
        node.tasks = [asyncio.create_task(worker(node.agent, f"{name}/w{i}",
                                                 random.Random(rng.random()), fail_p))
                      for i in range(workers)]
        node.tasks.append(asyncio.create_task(uplink(node, ctl, late if doomed else None)))
        cluster[name] = node

    for i in range(nodes):
        start(f"n{i}", doomed=kill_after is not None and i == 0)
    killed = expired = False
    try:
        async with asyncio.timeout(30):
            while len(ctl.scored) < total:
                if kill_after is not None and not killed and len(ctl.scored) >= kill_after:
                    dead = cluster.pop("n0")  # dies with work queued, running and unreported
                    for t in dead.tasks:
                        t.cancel()
                    await asyncio.gather(*dead.tasks, return_exceptions=True)
                    assert ctl.leases.leased("n0") > 0
                    ctl.gone("n0")
                    late.append(dead.agent.take_reports())
                    for out in late:  # its reports, after its leases came back: refused
                        ctl.apply("n0", out)
                    start("n0")  # restarted: a new epoch
                    killed = True
                if expire_after is not None and not expired and len(ctl.scored) >= expire_after:
                    # The controller's clock jumps past every lease: all come back while their
                    # agents live on; what those report of them next is refused.
                    ctl.now += 2 * ctl.leases.ttl_s
                    back = ctl.leases.expire(ctl.now)
                    assert back
                    for tid in back:
                        ctl.ix.fail(tid)
                    expired = True
                ctl.grant({name: node.agent for name, node in cluster.items()})
                ctl.wake.clear()
                await ctl.wake.wait()
    finally:
        for node in cluster.values():
            for t in node.tasks:
                t.cancel()
            await asyncio.gather(*node.tasks, return_exceptions=True)
    assert ctl.ix.statistics().rows == 0
    return ctl


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_node_dispatch_scores_every_row_once_as_central_dispatch_does(seed: int) -> None:
    ctl = await run(seed=seed)
    assert ctl.scored == central(40, 4)
    assert len(ctl.leases) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_expired_leases_come_back_and_their_agents_drop_them(seed: int) -> None:
    ctl = await run(seed=seed, fail_p=0.0, expire_after=60)
    assert ctl.scored == central(40, 4)
    assert ctl.refused or ctl.revoked
    assert set(ctl.refused) <= {Verdict.UNKNOWN_LEASE}
    assert len(ctl.leases) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_a_dead_agents_leases_come_back_and_every_row_is_scored_once(seed: int) -> None:
    ctl = await run(seed=seed, kill_after=60)
    assert ctl.scored == central(40, 4)
    assert ctl.refused  # the dead agent's late reports
    assert set(ctl.refused) <= {Verdict.UNKNOWN_LEASE}
    assert len(ctl.leases) == 0


def test_reports_travel_and_malformed_ones_are_refused() -> None:
    out = Reports(4, done=[(7, [1, 2], {"worker_id": "w", "task_id": 3})],  # type: ignore[typeddict-item]
                  given_back=[(7, 5)], held=[7])
    assert Reports.from_wire(out.to_wire()) == out
    for bad in (None, {"epoch": 1}, {**out.to_wire(), "epoch": "1"},
                {**out.to_wire(), "done": [[7, [1], None]]},
                {**out.to_wire(), "given_back": [[7]]}, {**out.to_wire(), "held": ["7"]}):
        with pytest.raises(ValueError, match=r"agent reports|completion|give-back|lease ids"):
            Reports.from_wire(bad)


async def test_a_poll_outliving_its_worker_takes_no_task() -> None:
    agent = LocalDispatch("a")
    agent.joined(1)
    api = DispatchApi(agent)
    api.admit("w1", b"t" * 16, STAGE)
    get_task = api.handlers()[m.OP_GET_TASK]
    with pytest.raises(PermissionError):
        await get_task({"worker_id": "w1", "token": b"u" * 16, "wait_s": 0.0}, b"")
    poll = asyncio.create_task(get_task({"worker_id": "w1", "token": b"t" * 16,
                                         "wait_s": 5.0}, b""))
    await asyncio.sleep(0)  # the poll waits
    assert api.forget("w1") == []
    assert await poll is None  # ended with the worker
    m1, _ = tasks(2)
    agent.add_lease(grant(7, 1, m1))
    assert agent.queued(STAGE) == 1  # for the node's other workers
    # Forgotten after a task was handed to its poll, before the poll returned it: the task
    # goes back to the controller, not to no one.
    api.admit("w2", b"t" * 16, STAGE)
    assert await get_task({"worker_id": "w2", "token": b"t" * 16, "wait_s": 5.0}, b"") == m1
    poll = asyncio.create_task(get_task({"worker_id": "w2", "token": b"t" * 16,
                                         "wait_s": 5.0}, b""))
    await asyncio.sleep(0)  # the poll waits
    m2 = tasks(2)[1]
    agent.add_lease(grant(8, 1, m2))  # handed to the poll, which has not returned it yet
    assert api.forget("w2") == [m1["task_id"], m2["task_id"]]
    assert await poll is None
    assert agent.take_reports().given_back == [(7, m1["task_id"]), (8, m2["task_id"])]


# ---- real workers, real sockets ------------------------------------------------------------

class Scorer:
    """A reward role: `score` of each row's response, inline (no store traffic)."""

    loads_weights = False

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput:
        await asyncio.sleep(0.001)  # the work: the other worker gets a share
        return RoleOutput(fields={"reward": [score(h) for h in inputs["response"]]})

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        return None


async def test_real_workers_poll_the_agent_and_every_row_is_scored_once() -> None:
    """Workers register with a stand-in controller (register, heartbeat, bye) and poll the
    agent's server for tasks (``WorkerConfig.tasks``). One worker stops mid-run: what it held
    goes back to the controller and is scored by the other."""
    run_id = new_run_id()
    run_dir(run_id)
    ctl = Controller(new_index(30, 4), Leases(ttl_s=1e9), budget=4, lease_size=2)
    epoch, _ = ctl.leases.join("n0")
    agent = LocalDispatch("n0")
    agent.joined(epoch)
    api = DispatchApi(agent)
    tokens: dict[str, bytes] = {}

    async def register(p: Any, peer: bytes) -> Any:
        wid = f"w{len(tokens)}"
        tokens[wid] = os.urandom(16)
        api.admit(wid, tokens[wid], STAGE)  # the controller tells the agent of its worker
        return {"worker_id": wid, "token": tokens[wid], "version": 0, "weights": None}

    async def ok(p: Any, peer: bytes) -> Any:
        return {"ok": True}

    async def bye(p: Any, peer: bytes) -> Any:
        api.forget(p["worker_id"])
        return {"ok": True}

    async def uplink() -> None:
        while True:
            out = await agent.reports(1.0)
            for lease in ctl.apply("n0", Reports.from_wire(out.to_wire())):
                agent.revoked(lease)

    server = RpcServer(ipc_endpoint(run_id, "ctl"),
                       {m.OP_REGISTER: register, m.OP_HEARTBEAT: ok, m.OP_BYE: bye})
    tasks = RpcServer(ipc_endpoint(run_id, "agent"), api.handlers(), long_polls=[m.OP_GET_TASK])
    pub = Publisher(ipc_endpoint(run_id, "pub"))
    store = StoreClient(run_id, "n0", ipc_endpoint(run_id, "store"))  # never used
    running: list[asyncio.Task[None]] = []
    workers: list[Worker] = []
    link = asyncio.create_task(uplink())
    try:
        await server.start()
        await tasks.start()
        await pub.start()
        for i in range(2):
            config = WorkerConfig(name=f"reward.{i}", role=STAGE, node="n0",
                                  controller=server.endpoint, broadcast=pub.endpoint,
                                  heartbeat_s=5.0, poll_s=5.0, rpc_timeout_s=5.0, capacity=2,
                                  tasks=tasks.endpoint)
            workers.append(Worker(config, Scorer(), store))
            running.append(asyncio.create_task(workers[-1].run()))
        async with RpcClient(tasks.endpoint) as intruder:
            with pytest.raises(TransportError, match="token"):
                await intruder.call(m.OP_GET_TASK, {"worker_id": "w0", "token": b"x" * 16,
                                                    "wait_s": 0.0})
        stopped = False
        async with asyncio.timeout(30):
            while len(ctl.scored) < 120:
                if not stopped and len(ctl.scored) >= 40:
                    workers[0].stop()
                    await running[0]
                    stopped = True
                ctl.grant({"n0": agent})
                ctl.wake.clear()
                await ctl.wake.wait()
        assert stopped
        assert ctl.scored == central(30, 4)
        assert ctl.refused == []
        assert ctl.ix.statistics().rows == 0
    finally:
        link.cancel()
        for w in workers:
            w.stop()
        async with asyncio.timeout(10):
            await asyncio.gather(link, *running, return_exceptions=True)
        await store.aclose()
        await pub.aclose()
        await tasks.aclose()
        await server.aclose()
        remove_run_dir(run_id)
