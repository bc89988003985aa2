"""The calls workers make (`flowrl.messages`), checked at the door.

Every request is validated here before it reaches the controller: a call in a registered
worker's name must carry that worker's token (so another local process that learnt or guessed
a worker id cannot act as it), numbers are bounded, and a task report is parsed and checked
against its task (`flowrl.control.reports`) before anything changes. A malformed request is
answered with an error and changes nothing; a malformed task *report* fails its task, so its
rows are redone elsewhere instead of lost.

Workers pull tasks with long polls: each registered worker has a mailbox the scheduler fills
and its ``get_task`` polls empty. A poll that finds the mailbox empty is parked in it
(`transport.rpc.Parked`: no task, timer or future a poll), and the next task delivered answers
the oldest poll still open.
"""

from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from flowrl import messages as m
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.reports import MalformedReport, TaskReport, parse_report
from flowrl.registry import Registry, WorkerInfo
from transport.pubsub import DroppedSubscriber
from transport.rpc import Handler, Parked

__all__ = ["MAX_CAPACITY", "MAX_WAIT_S", "WorkerApi", "WorkerEvents"]

log = structlog.get_logger("flowrl.controller")

#: the most tasks one worker may run at once (a bound on what one registration can claim)
MAX_CAPACITY = 1024
#: the longest long poll a worker may ask for
MAX_WAIT_S = 600.0


class WorkerEvents(Protocol):
    """What the controller does with the calls `WorkerApi` accepted."""

    def worker_registered(self, info: WorkerInfo) -> dict[str, Any]: ...

    def task_reported(self, a: Assignment, report: TaskReport) -> None: ...

    def task_failed(self, a: Assignment, error: str) -> None: ...

    def workers_serve(self, served: list[tuple[WorkerInfo, int]],
                      interrupted: list[tuple[WorkerInfo, int, int]]) -> None: ...

    def node_dropped(self, node: str, dropped: DroppedSubscriber) -> None: ...

    def sync_failed(self, info: WorkerInfo, version: int, error: str) -> None: ...

    def start_failed(self, process: str, token: str, error: str) -> None: ...

    def worker_gone(self, worker_id: str, why: str) -> None: ...

    def node_up(self, store: str, peer_store: str | None,
                relay: tuple[str, str] | None = None) -> bool: ...


class Mailbox:
    """A worker's tasks not taken yet, and its polls waiting for one (oldest first)."""

    __slots__ = ("polls", "tasks")

    def __init__(self) -> None:
        self.tasks: deque[m.TaskMsg] = deque()
        self.polls: deque[Parked] = deque()


class WorkerApi:
    def __init__(self, registry: Registry, assignments: Assignments, events: WorkerEvents,
                 *, has_role: Callable[[str], bool], now: Callable[[], float],
                 node_token: Callable[[str], bytes | None] = lambda node: None) -> None:
        """``has_role(role)``: whether the pipeline has a pool for ``role``; ``now()``: the
        clock heartbeats are measured with; ``node_token(node)``: the token of that node's
        agent (None: no such node)."""
        self.registry = registry
        self.assignments = assignments
        self.events = events
        self._has_role = has_role
        self._now = now
        self._node_token = node_token
        self._mailboxes: dict[str, Mailbox] = {}

    def handlers(self) -> dict[str, Handler]:
        as_worker = self._as_worker
        return {
            m.OP_REGISTER: self._register,
            m.OP_HEARTBEAT: as_worker(self._heartbeat),
            m.OP_GET_TASK: as_worker(self._get_task),
            m.OP_TASK_DONE: as_worker(self._task_done),
            m.OP_TASK_FAILED: as_worker(self._task_failed),
            m.OP_SERVED: as_worker(self._served),
            m.OP_NODE_SERVED: self._node_served,
            m.OP_NODE_HEARTBEAT: self._node_heartbeat,
            m.OP_BYE: as_worker(self._bye),
            m.OP_SYNC_FAILED: as_worker(self._sync_failed),
            m.OP_START_FAILED: self._start_failed,
            "node_up": self._node_up,
        }

    # ---- mailboxes -------------------------------------------------------------------------

    def deliver(self, worker_id: str, a: Assignment,
                sent: Callable[[], None] | None = None) -> None:
        """``a`` to its worker's oldest open poll, or queued for its next one. ``sent()`` once
        the reply carrying it has left (`Parked.sent`); at once if it was queued (its worker's
        poll is on its way, and takes it as it comes)."""
        box = self._mailboxes[worker_id]
        polls = box.polls
        while polls:
            poll = polls.popleft()
            if poll.open:  # not expired (answered "nothing"), its server not closed
                a.started_at = time.time()
                poll.sent = sent
                poll.answer(a.message())
                return
        box.tasks.append(a.message())
        if sent is not None:
            sent()

    def close_mailbox(self, worker_id: str) -> None:
        """The worker is gone: its open polls expire as they would (answered "nothing")."""
        self._mailboxes.pop(worker_id, None)

    def empty_mailbox(self, worker_id: str) -> None:
        """Drop what waits for ``worker_id`` (tasks given back before it took them)."""
        box = self._mailboxes.get(worker_id)
        if box is not None:
            box.tasks.clear()

    # ---- handlers --------------------------------------------------------------------------

    def _as_worker(self, handler: Handler) -> Handler:
        """``handler`` for calls in a worker's name: a call naming a registered worker must
        carry the token of that worker's register reply. Unknown ids reach the handler, which
        answers them as it always has."""
        def checked(p: Any, peer: bytes) -> Any:
            wid = p.get("worker_id") if isinstance(p, dict) else None
            info = self.registry.get(wid) if type(wid) is str else None
            if info is not None and not _carries(p, info.token):
                raise PermissionError(f"a call for worker {wid} without its token")
            return handler(p, peer)
        return checked

    def _register(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        role = _str(p, "role")
        if not self._has_role(role):
            raise ValueError(f"no pool for role {role!r} in this pipeline")
        name, node = _str(p, "name"), _str(p, "node")
        pid, capacity = _int(p, "pid", 1, 2**31), _int(p, "capacity", 1, MAX_CAPACITY)
        info = self.registry.register(name=name, role=role, node=node, pid=pid,
                                      capacity=capacity, version=0, now=self._now())
        self._mailboxes[info.worker_id] = Mailbox()
        return self.events.worker_registered(info)

    def _heartbeat(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        info = self.registry.heartbeat(_str(p, "worker_id"), self._now())
        return {"ok": info is not None}

    def _get_task(self, p: dict[str, Any], peer: bytes) -> m.TaskMsg | Parked | None:
        """The worker's next task: at once when one waits in its mailbox (a worker holds up
        to ``tasks_per_slot`` tasks, so after a report one often does), else the poll parked
        in its mailbox until one comes (`deliver`) or ``wait_s`` pass (None)."""
        worker_id = _str(p, "worker_id")
        wait_s = _seconds(p, "wait_s")
        done = p.get("done")
        if done is not None:
            self._reported(done, worker_id)
        box = self._mailboxes.get(worker_id)
        if box is None:
            return None
        if box.tasks:
            return self._started(box.tasks.popleft())
        polls = box.polls
        while polls and not polls[0].open:  # expired since: answered "nothing" already
            polls.popleft()
        poll = Parked(wait_s)
        polls.append(poll)
        return poll

    def _started(self, msg: m.TaskMsg) -> m.TaskMsg:
        a = self.assignments.get(msg["task_id"])
        if a is not None:
            a.started_at = time.time()
        return msg

    def _reported(self, done: Any, poller: str) -> None:
        """A task's report that came with the worker's next poll: taken as ``task_done``; one
        that cannot be taken fails its task (its rows go to another worker), not the poll. A
        worker reports only its own tasks (its poll carried its token, not the report)."""
        if not isinstance(done, dict) or done.get("worker_id") != poller:
            log.warning("ignored a malformed task report", report=repr(done)[:200])
            return
        try:
            self._take_report(done)
        except MalformedReport as exc:
            log.warning("ignored a malformed task report", error=str(exc))

    def _task_done(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        return {"ok": self._take_report(p)}

    def _take_report(self, p: dict[str, Any]) -> bool:
        """Apply a report, or fail its task if it cannot be taken; False for a report of a
        task the worker does not hold (a late one, from a worker declared dead)."""
        task_id, worker_id = p.get("task_id"), p.get("worker_id")
        a = self.assignments.get(task_id) if type(task_id) is int else None
        if a is None or a.worker != worker_id:
            if type(task_id) is not int or type(worker_id) is not str:
                raise MalformedReport("a task report must name its 'worker_id' and 'task_id'")
            return False
        try:
            report = parse_report(p)
            self.events.task_reported(a, report)
        except MalformedReport as exc:
            log.warning("refused a task report", worker=worker_id, task=task_id,
                        error=str(exc))
            self.events.task_failed(a, f"malformed task report: {exc}")
        return True

    def _task_failed(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        task_id, worker_id = _int(p, "task_id", 0, 2**62), _str(p, "worker_id")
        a = self.assignments.get(task_id)
        if a is not None and a.worker == worker_id:
            self.events.task_failed(a, str(p.get("error", ""))[:2000])
        return {"ok": True}

    def _served(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        info = self.registry.get(_str(p, "worker_id"))
        interrupted, continued = (_int(p, key, 0, 2**31) if key in p else 0
                                  for key in ("interrupted", "continued"))
        if info is not None:
            self.events.workers_serve([(info, _int(p, "version", 0, 2**62))],
                                      [(info, interrupted, continued)] if interrupted else [])
        return {"ok": True}

    def _node_served(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        """A node agent's gathered ``served`` reports and relay drops (`flowrl.node_relay`).
        The request must carry the node's token; each entry is taken as the worker's own
        ``served`` would be (its token, and it must be registered on that node), and one that
        is not is skipped, not the request: a worker that died before its agent reported is
        no longer registered, so it is not counted as serving."""
        node = self._node(p, m.OP_NODE_SERVED)
        entries, drops = p.get("served"), p.get("dropped", [])
        if (type(entries) is not list or type(drops) is not list
                or len(entries) > m.MAX_NODE_SERVED or len(drops) > m.MAX_NODE_SERVED):
            raise ValueError(f"'served' and 'dropped' must be lists of at most "
                             f"{m.MAX_NODE_SERVED}")
        served: list[tuple[WorkerInfo, int]] = []
        interrupts: list[tuple[WorkerInfo, int, int]] = []
        get = self.registry.get
        for e in entries:  # [worker id, token, version(, interrupted, continued)]
            n = len(e) if type(e) is list else 0
            wid = e[0] if n in (3, 5) else None
            info = get(wid) if type(wid) is str else None
            if info is None or info.node != node:
                continue  # gone meanwhile (or never this node's), or not an entry
            if not _is_token(e[1], info.token):
                log.warning("ignored a served report without its worker's token",
                            worker=wid, node=node)
                continue
            version = e[2]
            interrupted, continued = (e[3], e[4]) if n == 5 else (0, 0)
            if not (type(version) is int and 0 <= version <= 2**62
                    and type(interrupted) is int and 0 <= interrupted <= 2**31
                    and type(continued) is int and 0 <= continued <= 2**31):
                log.warning("ignored a malformed served report", worker=wid,
                            entry=repr(e[2:])[:200])
                continue
            served.append((info, version))
            if interrupted:
                interrupts.append((info, interrupted, continued))
        if served:
            self.events.workers_serve(served, interrupts)
        for d in drops:
            if not (isinstance(d, dict) and type(d.get("name")) is str
                    and type(d.get("reason")) is str and type(d.get("connected")) is bool):
                continue
            self.events.node_dropped(node, DroppedSubscriber(d["name"], "", d["reason"][:200],
                                                             d["connected"]))
        return {"ok": True, "served": len(served)}

    def _node_heartbeat(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        """A node agent's gathered heartbeats (`flowrl.node_relay`): each entry renews its
        worker's deadline as the worker's own heartbeat would; the reply names the workers
        that are no longer registered (their agent tells them to exit). An entry with a wrong
        token, or of another node's worker, is skipped and not named."""
        node = self._node(p, m.OP_NODE_HEARTBEAT)
        entries = p.get("workers")
        if type(entries) is not list or len(entries) > m.MAX_NODE_SERVED:
            raise ValueError(f"'workers' must be a list of at most {m.MAX_NODE_SERVED}")
        now = self._now()
        unknown: list[str] = []
        get, heartbeat = self.registry.get, self.registry.heartbeat
        for e in entries:  # [worker id, token]
            wid = e[0] if type(e) is list and len(e) == 2 else None
            if type(wid) is not str:
                continue
            info = get(wid)
            if info is None:
                unknown.append(wid)
                continue
            if info.node == node and _is_token(e[1], info.token):
                heartbeat(wid, now)
        return {"ok": True, "unknown": unknown}

    def _node(self, p: Any, op: str) -> str:
        """The node a node agent's request names, checked against the node's token."""
        node = _str(p, "node")
        expected = self._node_token(node)
        if expected is None or not _carries(p, expected):
            raise PermissionError(f"a {op} for node {node!r} without its token")
        return node

    def _sync_failed(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        """A worker missed its weight-sync deadline: it exits next, and its process is
        restarted like any dead worker (bounded by ``max_restarts``)."""
        info = self.registry.get(_str(p, "worker_id"))
        if info is None:
            return {"ok": False}
        self.events.sync_failed(info, _int(p, "version", 0, 2**62), _str(p, "error")[:500])
        return {"ok": True}

    def _start_failed(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        """A worker process could not start. It has no worker id yet: the start token of its
        spec vouches for it (checked by the workforce, which refuses a wrong one)."""
        self.events.start_failed(_str(p, "process"), _str(p, "token"), _str(p, "error")[:2000])
        return {"ok": True}

    def _bye(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        self.events.worker_gone(_str(p, "worker_id"), "said bye")
        return {"ok": True}

    def _node_up(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        peer_store = p.get("peer_store")
        relay = (_str(p, "broadcast"), _str(p, "relay")) if "relay" in p else None
        ok = self.events.node_up(_str(p, "store"),
                                 peer_store if isinstance(peer_store, str) and peer_store else None,
                                 relay)
        return {"ok": ok}


# ---- request validation (a malformed request is answered with an error and changes nothing) --

def _carries(p: dict[str, Any], token: bytes) -> bool:
    """Whether request ``p`` carries ``token``."""
    return _is_token(p.get("token"), token)


def _is_token(given: Any, token: bytes) -> bool:
    """Whether ``given`` is ``token`` (compared in constant time)."""
    return type(given) is bytes and hmac.compare_digest(given, token)


def _str(p: Any, key: str) -> str:
    value = p.get(key) if isinstance(p, dict) else None
    if type(value) is not str:
        raise ValueError(f"{key!r} must be a string")
    return value


def _int(p: Any, key: str, lo: int, hi: int) -> int:
    value = p.get(key) if isinstance(p, dict) else None
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise ValueError(f"{key!r} must be an integer in [{lo}, {hi}]")
    return value


def _seconds(p: Any, key: str) -> float:
    value: Any = p.get(key) if isinstance(p, dict) else None
    if not (type(value) in (int, float) and 0.0 <= value <= MAX_WAIT_S):  # NaN fails too
        raise ValueError(f"{key!r} must be a number of seconds in [0, {MAX_WAIT_S}]")
    return float(value)
