"""Node-local dispatch wired into a run (``placement.node_dispatch``): the controller's side.

Workers of a row-level stage (`flowrl.control.leases.leasable`: reward, reference, critic), and
rollout workers unless placement is colocated, on a node whose agent dispatches itself are taken
out of central dispatch (`Registry.lease_out`): each dispatch pass leases that node's agent ready
tasks of their stage instead, as many as its workers have room for (`split` balances scarce work
over the nodes). The agent runs them on its workers (`flowrl.node_dispatch`) and reports
completions in batches; an accepted completion goes through the same report path as a central
one (`Controller.task_reported`: checked against its task, then applied to the index), a refused
one is dropped.

Rollout. The scheduler forms every rollout task without a worker (`Scheduler.admit_ahead`: as
soon as the staleness gate admits its groups, the next step's while the trainer trains; groups
given back are formed again), each with the oldest policy version that may generate it. Each
pass splits the formed tasks over the dispatching nodes and the controller's own, by room; a
node's share is leased in one lease per version needed, which its agent holds until a worker of
its serves that version (its `served` report reaches the agent first). So at a version switch
the controller hands out only its own node's share; the rest was granted while the trainer
trained. A lease whose tasks need a version newer than the trainer's holds no running task, so
it can be taken back whole (`recall`): on `Controller.pause` (those tasks would never drain)
and when the scheduler gives back what is past the staleness gate (`withdraw_beyond_gate`).

What the agent is told travels on its long poll (`OP_LEASE_POLL`: grants, workers to admit with
their tokens or to forget, revoked leases); what it reports on `OP_LEASE_REPORT`, whose reply
names the leases it may no longer hold. Leases expire on a timer (`run`): an agent that stops
renewing its leases (it renews with every report) gives their tasks back, rows to the front of
their stage's queue.

Leased tasks are also `Assignments` (of the pseudo-worker ``lease:<node>`` until one of the
node's workers reports them), so a pause drains them and progress is measured as for central
tasks. Only the agents of nodes other than the controller's dispatch themselves (the
controller's own node has no agent process of that kind).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from flowrl import messages as m
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.leases import Leases, Verdict, leasable, split
from flowrl.control.reports import MalformedReport, TaskReport, parse_report
from flowrl.control.scheduler import Scheduler, find_source_stage
from flowrl.graph import StageGraph, StageSpec
from flowrl.index import Index, Task
from flowrl.node_dispatch import OP_LEASE_JOIN, OP_LEASE_POLL, OP_LEASE_REPORT, Reports
from flowrl.pipeline import PipelineSpec
from flowrl.registry import Registry, WorkerInfo
from transport.rpc import Handler

__all__ = ["LEASE_TTL_S", "NodeLeases", "dispatching_nodes", "leased_roles"]

log = structlog.get_logger("flowrl.controller")

#: a lease not renewed this long (its agent silent) gives its tasks back
LEASE_TTL_S = 30.0
#: the longest wait of an agent's long poll for commands
_POLL_S = 2.0


def leased_roles(graph: StageGraph, *, rollout: bool = True) -> dict[str, StageSpec]:
    """Role -> the stage its workers run, for the roles node agents may dispatch (each runs
    exactly one stage): the row-level ones, and the source (rollout) unless ``rollout`` is
    False (colocated placement: a rollout worker's process takes turns with a trainer's, which
    only the controller sees). ValueError for a role of two stages."""
    source = find_source_stage(graph)
    out: dict[str, StageSpec] = {}
    for stage in graph.order:
        if not (leasable(stage) if stage is not source else rollout):
            continue
        if stage.role in out:
            raise ValueError(f"node dispatch needs one stage per role; role {stage.role!r} "
                             f"runs {out[stage.role].name!r} and {stage.name!r}")
        out[stage.role] = stage
    return out


@dataclass
class _Node:
    name: str
    #: stage -> task slots of the node's leased workers (capacity * tasks per slot)
    slots: dict[str, int] = field(default_factory=dict)
    #: worker id -> its admit command ({worker_id, token, stage})
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    admit: list[dict[str, Any]] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    grant: list[dict[str, Any]] = field(default_factory=list)
    revoke: list[int] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def pending(self) -> bool:
        return bool(self.admit or self.forget or self.grant or self.revoke)


#: `split`'s name for the controller's own node (node names are never empty)
_HERE = ""


class NodeLeases:
    def __init__(
        self, graph: StageGraph, index: Index, registry: Registry, assignments: Assignments,
        *, nodes: set[str], reported: Callable[[Assignment, TaskReport], None],
        failed: Callable[[Assignment, str], None], give_back: Callable[[int], None],
        wake: Callable[[], None], now: Callable[[], float],
        scheduler: Scheduler | None = None,
        ttl_s: float = LEASE_TTL_S, renew_s: float | None = None,
    ) -> None:
        """``nodes``: the nodes whose agents dispatch themselves. ``reported`` / ``failed``:
        the controller's report path for an accepted completion (and for one it cannot take),
        without a dispatch pass each: ``wake`` runs one for an agent's whole report;
        ``give_back(task_id)``: a task's rows back to their queue; ``now``: the lease clock.
        ``scheduler``: the run's, whose rollout tasks formed ahead are leased too (None: rollout
        stays central). ``renew_s``: how often agents report at the least (so renew),
        ``ttl_s / 3`` unless told."""
        self.roles = leased_roles(graph, rollout=scheduler is not None)
        self.scheduler = scheduler
        self.source = None if scheduler is None else scheduler.source
        if scheduler is not None:
            scheduler.recall = self.recall
        self.index = index
        self.registry = registry
        self.assignments = assignments
        self.leases = Leases(ttl_s=ttl_s)
        self.renew_s = ttl_s / 3 if renew_s is None else renew_s
        self._nodes = {n: _Node(n) for n in sorted(nodes)}
        self._reported = reported
        self._failed = failed
        self._give_back = give_back
        self._wake = wake
        self._now = now
        self._worker_node: dict[str, str] = {}
        #: completions and give-backs refused (late, repeated, of a returned lease)
        self.refused = 0
        #: leased tasks reported run under a policy version older than their lease's need
        self.below_need = 0
        #: tasks given back by agents (failed, their worker gone) and taken back by expiry
        self.given_back = 0
        self.expired = 0
        #: tasks of leases taken back from lost agents
        self.lost_back = 0
        #: rollout tasks taken back before any worker could run them (`recall`)
        self.recalled = 0
        #: rollout tasks leased
        self.rollout_leased = 0
        #: leases granted, and tasks in them
        self.granted = 0
        self.tasks_leased = 0
        #: called after each grant, and after each report of an agent is taken (tests wait on
        #: them)
        self.on_grant: list[Callable[[], None]] = []
        self.on_report: list[Callable[[], None]] = []

    # ---- workers (the controller's hooks) ---------------------------------------------------

    def registered(self, info: WorkerInfo) -> None:
        """A worker registered: one of a dispatching node's leased roles is the agent's to
        dispatch from now on (before any central pass could pick it)."""
        node = self._nodes.get(info.node)
        stage = self.roles.get(info.role)
        if node is None or stage is None:
            return
        self.registry.lease_out(info)
        node.slots[stage.name] = (node.slots.get(stage.name, 0)
                                  + info.capacity * self.registry.tasks_per_slot)
        cmd = {"worker_id": info.worker_id, "token": info.token, "stage": stage.name,
               "version": info.version}
        node.workers[info.worker_id] = cmd
        self._worker_node[info.worker_id] = node.name
        node.admit.append(cmd)
        node.wake.set()

    def gone(self, info: WorkerInfo) -> None:
        """A worker left: its agent forgets it (and gives back what it held)."""
        name = self._worker_node.pop(info.worker_id, None)
        if name is None:
            return
        node = self._nodes[name]
        stage = node.workers.pop(info.worker_id)["stage"]
        node.slots[stage] -= info.capacity * self.registry.tasks_per_slot
        node.forget.append(info.worker_id)
        node.wake.set()

    def node_gone(self, name: str) -> None:
        """``name``'s agent was lost: its leases' tasks come back."""
        if name in self._nodes:
            back = self.leases.node_gone(name)
            self.lost_back += len(back)
            self._back(back)

    # ---- dispatch ---------------------------------------------------------------------------

    def dispatch(self, now: float) -> None:
        """Lease every dispatching node ready tasks of its workers' stages, up to their room.
        ``now``: the controller's dispatch clock (as `Scheduler.dispatch`)."""
        for stage in self.roles.values():
            if stage is self.source:
                self._lease_formed(stage, now)
                continue
            ready = self.index.ready_units(stage.name)
            if not ready:
                continue
            room = self._room(stage)
            want = -(-ready // max(1, stage.micro_batch))
            for name, k in split(want, room).items():
                tasks: list[Task] = []
                while len(tasks) < k:
                    task = self.index.request(stage.name, stage.micro_batch,
                                              worker=f"lease:{name}")
                    if task is None:
                        break
                    tasks.append(task)
                if tasks:
                    self._grant(self._nodes[name], stage, tasks, now)
                if len(tasks) < k:
                    break  # the queue ran dry

    def _room(self, stage: StageSpec) -> dict[str, int]:
        """Tasks of ``stage`` each node with a live agent has room for: its workers' slots less
        what it holds."""
        return {n.name: n.slots.get(stage.name, 0) - self.leases.held(n.name, stage.name)
                for n in self._nodes.values() if self.leases.epoch(n.name) is not None}

    def _lease_formed(self, stage: StageSpec, now: float) -> None:
        """Rollout: the tasks the scheduler formed (`admit_ahead`, and groups given back) are
        split over the nodes by room, the controller's own node counted by the free slots of
        its workers that have one; its share stays with the scheduler, which hands out what its
        workers may run now (`Scheduler.dispatch_formed`). A node's tasks go in one lease per
        policy version they need, so that those no worker may run yet can be taken back whole
        (`recall`)."""
        scheduler = self.scheduler
        assert scheduler is not None
        waiting = scheduler.formed_waiting()
        if not waiting:
            return
        room = self._room(stage)
        room[_HERE] = self.registry.open_count(stage.role) * self.registry.tasks_per_slot
        shares = split(waiting, room)
        keep = shares.pop(_HERE, 0)
        formed = scheduler.take_formed(keep, sum(shares.values()))
        for name, k in sorted(shares.items()):
            mine, formed = formed[:k], formed[k:]
            for need, same in itertools.groupby(mine, key=lambda pair: pair[1]):
                tasks = [self.index.bind(t.id, f"lease:{name}") for t, _ in same]
                self._grant(self._nodes[name], stage, tasks, now, need=need)
                self.rollout_leased += len(tasks)
        if keep:
            scheduler.dispatch_formed(now, keep)

    def recall(self, version: int) -> list[int]:
        """Take back the rollout leases whose tasks no worker may run before a policy version
        newer than ``version`` (so none has started): their tasks' ids, for the caller to fail
        back into the index. Their agents are told to drop them."""
        back: list[int] = []
        if self.source is None:
            return back
        for node in self._nodes.values():
            gone = [x.id for x in self.leases.of_node(node.name)
                    if x.stage == self.source.name and x.need > version]
            for lid in gone:
                back.extend(self.leases.revoke(lid))
            if gone:
                node.revoke.extend(gone)
                node.wake.set()
        for tid in back:
            self.assignments.pop(tid)
        self.recalled += len(back)
        return back

    def _grant(self, node: _Node, stage: StageSpec, tasks: list[Task], now: float,
               need: int | None = None) -> None:
        epoch = self.leases.epoch(node.name)
        assert epoch is not None
        lease = self.leases.grant(node.name, epoch, stage.name, tasks, self._now(), need or 0)
        msgs: list[m.TaskMsg] = []
        started = time.time()
        for t in tasks:
            a = Assignment(t, f"lease:{node.name}", {}, now, started)
            self.assignments.add(a)
            msgs.append(a.message())
        grant: dict[str, Any] = {"lease": lease.id, "epoch": epoch, "stage": stage.name,
                                 "tasks": msgs}
        if need is not None:
            grant["needs"] = [need] * len(msgs)
        node.grant.append(grant)
        node.wake.set()
        self.granted += 1
        self.tasks_leased += len(tasks)
        for callback in self.on_grant:
            callback()

    def _back(self, task_ids: list[int]) -> None:
        for tid in task_ids:
            if self.assignments.pop(tid) is not None:
                self._give_back(tid)
        if task_ids:
            self._wake()

    # ---- expiry -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Expire leases not renewed in time, on a timer to the earliest expiry."""
        while True:
            now = self._now()
            expiries = [x.expires_at for n in self._nodes for x in self.leases.of_node(n)]
            await asyncio.sleep(max(0.0, min(expiries) - now) if expiries
                                else self.leases.ttl_s)
            self.expire(self._now())

    def expire(self, now: float) -> int:
        """Take back every lease not renewed by ``now``; the number of tasks given back."""
        for node in self._nodes.values():
            gone = [x.id for x in self.leases.of_node(node.name) if x.expires_at <= now]
            if gone:
                node.revoke.extend(gone)
                node.wake.set()
        back = self.leases.expire(now)
        self.expired += len(back)
        if back:
            log.warning("leases expired", tasks=len(back))
        self._back(back)
        return len(back)

    # ---- the agents' calls ------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """What ``status`` shows (``leases``): per dispatching node, its agent's epoch (None:
        not joined, or lost) and the tasks it holds by stage; the run's counts."""
        return {
            "nodes": {n: {"epoch": self.leases.epoch(n),
                          "held": {s.name: self.leases.held(n, s.name)
                                   for s in self.roles.values()}}
                      for n in self._nodes},
            "granted": self.granted, "tasks_leased": self.tasks_leased,
            "rollout_leased": self.rollout_leased, "given_back": self.given_back,
            "expired": self.expired, "lost_back": self.lost_back, "recalled": self.recalled,
            "refused": self.refused, "below_need": self.below_need}

    def handlers(self) -> dict[str, Handler]:
        return {OP_LEASE_JOIN: self._join, OP_LEASE_POLL: self._poll,
                OP_LEASE_REPORT: self._report}

    def _node(self, p: Any) -> _Node:
        name = p.get("node") if isinstance(p, dict) else None
        node = self._nodes.get(name) if type(name) is str else None
        if node is None:
            raise ValueError(f"node {name!r} does not dispatch itself in this run")
        return node

    async def _join(self, p: Any, peer: bytes) -> dict[str, Any]:
        node = self._node(p)
        epoch, back = self.leases.join(node.name)
        self._back(back)
        # A new incarnation starts afresh: every worker of the node is admitted again.
        node.admit, node.forget, node.grant, node.revoke = list(node.workers.values()), [], [], []
        node.wake.set()
        log.info("node dispatches its workers' tasks", node=node.name, epoch=epoch)
        self._wake()
        return {"epoch": epoch, "stages": {r: s.name for r, s in self.roles.items()},
                "renew_s": self.renew_s}

    async def _poll(self, p: Any, peer: bytes) -> dict[str, Any]:
        node = self._node(p)
        epoch = p.get("epoch")
        if epoch != self.leases.epoch(node.name):
            raise ValueError(f"node {node.name!r}: epoch {epoch!r} is not its agent's")
        wait_s: Any = p.get("wait_s", _POLL_S)
        if not node.pending():
            node.wake.clear()
            try:
                async with asyncio.timeout(min(float(wait_s), _POLL_S * 5)):
                    await node.wake.wait()
            except TimeoutError:
                pass
        out = {"admit": node.admit, "forget": node.forget, "grant": node.grant,
               "revoke": node.revoke}
        node.admit, node.forget, node.grant, node.revoke = [], [], [], []
        return out

    async def _report(self, p: Any, peer: bytes) -> dict[str, Any]:
        node = self._node(p)
        reports = Reports.from_wire(p)
        now = self._now()
        ep = reports.epoch
        for lease, rows, done in reports.done:
            tid = done.get("task_id") if isinstance(done, dict) else None
            if type(tid) is not int:
                self.refused += 1
                continue
            holder = self.leases.holder(tid)
            need = 0 if holder is None else holder.need
            verdict = self.leases.complete(node.name, ep, lease, tid, rows, now)
            a = self.assignments.get(tid) if verdict is Verdict.ACCEPTED else None
            if a is None:
                self.refused += 1
                continue
            version = done.get("version")
            if type(version) is int and version < need:
                # The agent broke its rule (a worker serving `need` or newer): the staleness
                # gate still evicts rows too old to train, but the run should say so.
                self.below_need += 1
                log.warning("a leased task ran under a policy version older than it needs",
                            node=node.name, task=tid, version=version, need=need)
            worker = done.get("worker_id")
            if type(worker) is str and self._worker_node.get(worker) == node.name:
                a.worker = worker  # spans and the trace name the worker that ran it
            try:
                self._reported(a, parse_report(done))
            except MalformedReport as exc:
                log.warning("refused a task report", node=node.name, task=tid, error=str(exc))
                self._failed(a, f"malformed task report: {exc}")
        back = []
        for lease, tid in reports.given_back:
            if self.leases.give_back(node.name, ep, lease, tid, now) is Verdict.ACCEPTED:
                back.append(tid)
            else:
                self.refused += 1
        self.given_back += len(back)
        self._back(back)
        revoked = [lid for lid in reports.held
                   if self.leases.renew(node.name, ep, lid, now) is not Verdict.ACCEPTED]
        self._wake()
        for callback in self.on_report:
            callback()
        return {"revoked": revoked}


def dispatching_nodes(spec: PipelineSpec, node: str) -> set[str]:
    """The nodes whose agents dispatch themselves under ``spec.node_dispatch``: those other
    than the controller's ``node`` that run workers of a leased role. ValueError (naming what
    is missing) when there are none, or with evaluation, whose scoring jobs stay central."""
    roles = leased_roles(spec.graph(), rollout=not spec.colocated)
    nodes = {n for p in spec.pools if p.role in roles for n in p.nodes} - {node}
    if not nodes:
        raise ValueError(f"node_dispatch needs workers of {sorted(roles) or 'a row-level role'} "
                         f"on a node other than the controller's ({node!r}): "
                         "placement.roles places none there")
    if spec.eval is not None:
        raise ValueError("node_dispatch does not run evaluation rounds (eval): their scoring "
                         "jobs are dispatched centrally, to workers the agents now dispatch")
    return nodes
