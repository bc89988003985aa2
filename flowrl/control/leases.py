"""Leases: the controller's side of node-local dispatch of row-level stages.

Central dispatch costs the controller a long poll and a report per task per worker; at a
thousand workers those messages bound it (bench/README.md, capacity). With leases the
controller hands a node agent a batch of ready tasks of one row-level stage at once (a lease);
the agent runs them on its own node's workers from a local ready queue
(`flowrl.node_dispatch`) and sends completions back in batches. The controller keeps every
global decision: what is admitted, staleness, step commits, versions, and how much each node
is leased (cross-node balancing).

Unit of a lease. The controller still forms the micro-batches (`Index.request`, cheap and
local, no message): a lease holds index tasks, each naming its rows. So task ids, the index's
row accounting and what a run trains are those of central dispatch; what moves to the agent is
choosing a worker, the polls and the per-task reports. Row-level stages are leased (each task's
rows independent: reward, reference, critic), and rollout tasks formed by the scheduler, each
lease of those with the oldest policy version that may run its tasks (``need``; the agent waits
for a worker serving it); train micro-batches, under the step ledger, stay central.

Exactly once. A row is in at most one in-flight index task (`flowrl.index`), and this table
accepts a completion only when it names a live lease, from the node and agent epoch it was
granted to, for a task of that lease not completed yet, with that task's rows. Anything else
is refused (`Verdict`), changes nothing, and the caller drops the report. A lease ends when its
last task is completed or given back.

Nothing lost. A lease whose agent dies (`node_gone`), is replaced by a new incarnation of its
node's agent (`join` gives a new epoch), or is not renewed in time (`expire`) returns its
unfinished tasks: the caller fails them in the index (`Index.fail`), which puts their rows back
at the front of the stage's ready queue. A late completion of a returned task is then refused:
its lease is gone. An agent may also give back tasks it will not run (`give_back`).

Pure: no sockets, no clock (times are passed in).

Wired into runs by `flowrl.control.node_leases` (``placement.node_dispatch``;
docs/architecture.md, node-local dispatch).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flowrl.graph import StageSpec
from flowrl.index import Task

__all__ = ["Lease", "Leases", "Verdict", "leasable", "split"]


def leasable(stage: StageSpec) -> bool:
    """Whether a node agent may dispatch ``stage``: a row-level stage, each task's rows
    independent of every other row (not a group-level or version-bound one)."""
    return not stage.group_level and not stage.consumes_version_bound


def split(ready: int, room: Mapping[str, int]) -> dict[str, int]:
    """Cross-node balancing: how many of ``ready`` tasks to lease each node, given the tasks
    each has room for (its workers' free slots, less what it holds). As if tasks went one at a
    time to the node with the most room left (ties: by name): scarce work is spread over the
    nodes instead of filling the first, and no node gets more than its room.

    Computed as a water level, O(nodes × log(room)) whatever ``ready`` is (a dispatch pass may
    split a step's tasks): the lowest level ``L`` to which filling every node down leaves at
    most ``ready`` tasks; the few left over go one each to the nodes at that level, by name."""
    rooms = {n: r for n, r in room.items() if r > 0}
    if ready >= sum(rooms.values()):
        return rooms
    if ready <= 0:
        return {}

    def above(level: int) -> int:
        return sum(r - level for r in rooms.values() if r > level)

    lo, hi = 1, max(rooms.values())  # above(hi) == 0 <= ready < above(0), the total
    while lo < hi:
        mid = (lo + hi) // 2
        if above(mid) <= ready:
            hi = mid
        else:
            lo = mid + 1
    out = {n: r - lo for n, r in rooms.items() if r > lo}
    at_level = sorted(n for n, r in rooms.items() if r >= lo)
    for n in at_level[:ready - above(lo)]:
        out[n] = out.get(n, 0) + 1
    return out


class Verdict(enum.Enum):
    """The answer to a completion (or a give-back) of a leased task."""

    ACCEPTED = "accepted"
    #: no such lease: never granted, returned (its agent died or it expired) or finished
    UNKNOWN_LEASE = "unknown_lease"
    #: the lease is another node's
    OTHER_NODE = "other_node"
    #: the lease was granted to an earlier incarnation of this node's agent
    STALE_EPOCH = "stale_epoch"
    #: the task is not in this lease
    NOT_LEASED = "not_leased"
    #: the task of this lease was completed (or given back) already
    ALREADY_DONE = "already_done"
    #: the completion names rows other than the task's
    WRONG_ROWS = "wrong_rows"


@dataclass(slots=True)
class Lease:
    id: int
    node: str
    epoch: int
    stage: str
    #: controller clock; renewed by every call of its agent about it
    expires_at: float
    #: the oldest policy version that may run its tasks (rollout; 0: any)
    need: int = 0
    #: task id -> its rows, for the tasks not completed or given back yet
    open: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: tasks completed or given back
    closed: set[int] = field(default_factory=set)


class Leases:
    """Which node holds which tasks, under which lease, until when."""

    def __init__(self, *, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"a lease's ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._next_id = 1
        self._epochs: dict[str, int] = {}
        self._leases: dict[int, Lease] = {}
        self._by_node: dict[str, dict[int, None]] = {}
        #: tasks leased and not completed or returned, by task id (the lease holding each)
        self._holder: dict[int, int] = {}
        #: (node, stage) -> its tasks leased and not completed or returned (a dispatch pass
        #: asks for each node's room: counted as they change, not over the leases)
        self._open: dict[tuple[str, str], int] = {}

    # ---- agents ----------------------------------------------------------------------------

    def join(self, node: str) -> tuple[int, list[int]]:
        """A node's agent (re)joins: its new epoch, and the tasks of leases an earlier
        incarnation held (to fail back into the index)."""
        back = self.node_gone(node)
        epoch = self._epochs.get(node, 0) + 1
        self._epochs[node] = epoch
        self._by_node[node] = {}
        return epoch, back

    def epoch(self, node: str) -> int | None:
        """The epoch of ``node``'s live agent (None: none joined, or it is gone)."""
        return self._epochs.get(node) if node in self._by_node else None

    def node_gone(self, node: str) -> list[int]:
        """``node``'s agent died or left: its unfinished tasks, to fail back into the index.
        Its epoch is over: nothing it reports counts any more."""
        back: list[int] = []
        for lid in list(self._by_node.pop(node, ())):
            back.extend(self._return(lid))
        return back

    # ---- granting --------------------------------------------------------------------------

    def grant(self, node: str, epoch: int, stage: str, tasks: Sequence[Task],
              now: float, need: int = 0) -> Lease:
        """Lease ``tasks`` (freshly requested from the index, of ``stage``) to ``node``'s agent
        of ``epoch``; ``need``: the oldest policy version that may run them."""
        if self.epoch(node) != epoch:
            raise ValueError(f"node {node!r} has no live agent of epoch {epoch}")
        if not tasks:
            raise ValueError("a lease holds at least one task")
        lease = Lease(self._next_id, node, epoch, stage, now + self.ttl_s, need)
        for t in tasks:
            if t.stage != stage:
                raise ValueError(f"task {t.id} is of stage {t.stage!r}, not {stage!r}")
            if t.id in self._holder or t.id in lease.open:
                raise ValueError(f"task {t.id} is leased already")
            lease.open[t.id] = t.rows
        self._next_id += 1
        self._leases[lease.id] = lease
        self._by_node[node][lease.id] = None
        for tid in lease.open:
            self._holder[tid] = lease.id
        self._count(lease, len(lease.open))
        return lease

    def renew(self, node: str, epoch: int, lease_id: int, now: float) -> Verdict:
        """Push the lease's expiry ``ttl_s`` past ``now`` (its agent is alive and at it). Any
        other verdict than ACCEPTED: the lease is not the agent's any more; the agent is told to
        drop it (`flowrl.node_dispatch.LocalDispatch.revoked`)."""
        lease, verdict = self._check(node, epoch, lease_id)
        if lease is not None:
            lease.expires_at = now + self.ttl_s
        return verdict

    def revoke(self, lease_id: int) -> list[int]:
        """The controller takes ``lease_id`` back: its unfinished tasks, to fail back. A later
        completion of one is refused (its lease is gone)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return []
        del self._by_node[lease.node][lease_id]
        return self._return(lease_id)

    # ---- reports ---------------------------------------------------------------------------

    def complete(self, node: str, epoch: int, lease_id: int, task_id: int,
                 rows: Sequence[int], now: float) -> Verdict:
        """A worker of ``node`` completed ``task_id``: ACCEPTED at most once per task, and only
        then may the caller apply it to the index."""
        return self._close(node, epoch, lease_id, task_id, rows, now)

    def give_back(self, node: str, epoch: int, lease_id: int, task_id: int,
                  now: float) -> Verdict:
        """The agent will not run ``task_id`` (its worker failed it, or it sheds load): on
        ACCEPTED the caller fails it back into the index."""
        return self._close(node, epoch, lease_id, task_id, None, now)

    def _close(self, node: str, epoch: int, lease_id: int, task_id: int,
               rows: Sequence[int] | None, now: float) -> Verdict:
        lease, verdict = self._check(node, epoch, lease_id)
        if lease is None:
            return verdict
        want = lease.open.get(task_id)
        if want is None:
            return Verdict.ALREADY_DONE if task_id in lease.closed else Verdict.NOT_LEASED
        if rows is not None and tuple(rows) != want:
            return Verdict.WRONG_ROWS
        del lease.open[task_id]
        del self._holder[task_id]
        self._count(lease, -1)
        lease.closed.add(task_id)
        lease.expires_at = now + self.ttl_s
        if not lease.open:
            self._end(lease)
        return Verdict.ACCEPTED

    def _check(self, node: str, epoch: int, lease_id: int) -> tuple[Lease | None, Verdict]:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None, Verdict.UNKNOWN_LEASE
        if lease.node != node:
            return None, Verdict.OTHER_NODE
        if lease.epoch != epoch:
            return None, Verdict.STALE_EPOCH
        return lease, Verdict.ACCEPTED

    # ---- expiry ----------------------------------------------------------------------------

    def expire(self, now: float) -> list[int]:
        """Return every lease not renewed by ``now``: their unfinished tasks, to fail back."""
        back: list[int] = []
        for lease in [x for x in self._leases.values() if x.expires_at <= now]:
            del self._by_node[lease.node][lease.id]
            back.extend(self._return(lease.id))
        return back

    def _return(self, lease_id: int) -> list[int]:
        lease = self._leases.pop(lease_id)
        for tid in lease.open:
            del self._holder[tid]
        self._count(lease, -len(lease.open))
        return list(lease.open)

    def _count(self, lease: Lease, n: int) -> None:
        key = (lease.node, lease.stage)
        self._open[key] = self._open.get(key, 0) + n

    def _end(self, lease: Lease) -> None:
        del self._leases[lease.id]
        del self._by_node[lease.node][lease.id]

    # ---- views -----------------------------------------------------------------------------

    def holder(self, task_id: int) -> Lease | None:
        """The live lease holding ``task_id`` unfinished (None: not leased)."""
        lid = self._holder.get(task_id)
        return None if lid is None else self._leases[lid]

    def of_node(self, node: str) -> list[Lease]:
        return [self._leases[lid] for lid in self._by_node.get(node, ())]

    def held(self, node: str, stage: str) -> int:
        """Tasks of ``stage`` leased to ``node`` and not completed or returned (O(1))."""
        return self._open.get((node, stage), 0)

    def leased(self, node: str | None = None) -> int:
        """Tasks leased and unfinished (on ``node``, or on every node)."""
        leases: Iterable[Lease] = (self._leases.values() if node is None
                                   else self.of_node(node))
        return sum(len(x.open) for x in leases)

    def __len__(self) -> int:
        return len(self._leases)
