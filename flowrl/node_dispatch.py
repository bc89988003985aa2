"""A node agent's local dispatch: the agent's side of leases (`flowrl.control.leases`).

The controller leases the agent batches of tasks of row-level stages and of rollout (those with
the policy version each needs, `needs`); the agent keeps them in a local ready queue per stage
and hands them to its own node's workers, which long-poll it (`take`) the way they poll the
controller for the other stages, and report to it (`done`, `failed`). Completions and
give-backs leave in batches (`take_reports`, one message for many tasks): that is where the
controller's messages go down.

Routing. A worker keeps registering with the controller (its id, token, heartbeats and policy
versions stay central) and polls the agent only for the tasks of leased stages, so nothing else
in the worker changes; the agent serves the same ``get_task`` / ``task_done`` / ``task_failed``
shapes (`flowrl.messages`).

Exactly once, on this side: a queued task is handed to one worker; a report counts only from the
worker holding the task, once; a task's completion or give-back leaves for the controller once.
A worker that dies, or fails a task, gives its task back to the controller (its rows go to the
front of the controller's ready queue, as under central dispatch) rather than to another local
worker, so the two dispatches differ in who runs a row, never in what rows are run. The
controller checks every report against its lease table anyway: a report of a lease it took back
(the agent was declared dead, or the lease expired) is refused there.

On stop the agent gives back what it has queued (`abandon`); what its workers run when it dies
the controller takes back with its leases.

Pure asyncio: no sockets, no clock of its own (the long polls' timeouts aside).

Wired into runs by `flowrl.control.node_leases` (``placement.node_dispatch``;
docs/architecture.md, node-local dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from flowrl import messages as m
from transport.errors import RemoteError, UnknownOperation
from transport.rpc import Handler, RpcServer

__all__ = ["MAX_WAIT_S", "OP_LEASE_JOIN", "OP_LEASE_POLL", "OP_LEASE_REPORT", "AgentLink",
           "DispatchApi",
           "LocalDispatch", "MalformedLease", "Reports"]

log = structlog.get_logger("flowrl.node")

#: the longest long poll a worker may ask the agent for (as the controller allows)
MAX_WAIT_S = 600.0

#: an agent joins node-local dispatch: its epoch, the stage each leased role runs, timings
OP_LEASE_JOIN = "lease_join"
#: an agent's long poll for what the controller has for it: grants, workers to admit or
#: forget, leases revoked
OP_LEASE_POLL = "lease_poll"
#: an agent's batched completions and give-backs, and the leases it still holds (renewed)
OP_LEASE_REPORT = "lease_report"


class MalformedLease(ValueError):
    """A lease grant that is not ``{lease: int, epoch: int, stage: str, tasks: [TaskMsg]}``
    (with ``needs: [int]``, one per task, where tasks need a policy version)."""


@dataclass
class Reports:
    """What the agent tells the controller in one message, under its ``epoch``."""

    epoch: int
    #: (lease id, the task's rows, the worker's report) for each completed task
    done: list[tuple[int, list[int], m.DoneMsg]] = field(default_factory=list)
    #: (lease id, task id) for each task given back (failed, its worker gone, or never run)
    given_back: list[tuple[int, int]] = field(default_factory=list)
    #: leases with tasks still queued or running here (to renew)
    held: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.done or self.given_back)

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "done": [[lease, rows, d] for lease, rows, d in self.done],
                "given_back": [list(x) for x in self.given_back], "held": list(self.held)}

    @classmethod
    def from_wire(cls, p: Any) -> Reports:
        """The controller's reading of an agent's message; ValueError (and nothing read) for
        one of the wrong shape. The reports themselves are checked against the lease table
        and parsed as any task report (`flowrl.control.reports`) by the controller."""
        if not isinstance(p, dict):
            raise ValueError(f"agent reports are a mapping, got {type(p).__name__}")
        epoch: Any = p.get("epoch")
        done: Any = p.get("done")
        back: Any = p.get("given_back")
        held: Any = p.get("held")
        if type(epoch) is not int or not all(isinstance(x, list) for x in (done, back, held)):
            raise ValueError("agent reports carry an 'epoch' and the lists 'done', "
                             "'given_back' and 'held'")
        out = cls(epoch)
        for item in done:
            if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int
                    and isinstance(item[1], list) and all(type(r) is int for r in item[1])
                    and isinstance(item[2], dict)):
                raise ValueError("a completion is [lease id, rows, the task's report]")
            out.done.append((item[0], item[1], item[2]))  # type: ignore[arg-type]
        for item in back:
            if not (isinstance(item, list) and len(item) == 2
                    and all(type(x) is int for x in item)):
                raise ValueError("a give-back is [lease id, task id]")
            out.given_back.append((item[0], item[1]))
        if not all(type(x) is int for x in held):
            raise ValueError("'held' lists lease ids")
        out.held = list(held)
        return out


@dataclass(slots=True)
class _Held:
    lease: int
    msg: m.TaskMsg
    #: the oldest policy version a worker may run it under (0: any)
    need: int = 0
    worker: str | None = None  # None while queued


class LocalDispatch:
    def __init__(self, node: str) -> None:
        self.node = node
        #: the epoch the controller gave this agent (None before it joined)
        self.epoch: int | None = None
        self._queues: dict[str, deque[int]] = {}
        self._tasks: dict[int, _Held] = {}  # queued or running, by task id
        self._by_worker: dict[str, dict[int, None]] = {}
        #: per stage, the polls waiting for a task, oldest first: a queued task goes to the
        #: oldest, so a grant wakes as many polls as it has tasks, not every poll of the stage
        self._waiting: dict[str, deque[tuple[str, asyncio.Future[m.TaskMsg | None]]]] = {}
        self._out = Reports(0)
        self._out_event = asyncio.Event()
        #: the policy version each worker serves (its ``served`` reports; 0 until one came)
        self._versions: dict[str, int] = {}
        #: each worker's waiting polls, with their stage (a new version serves them at once)
        self._polls: dict[str, dict[asyncio.Future[m.TaskMsg | None], str]] = {}

    def joined(self, epoch: int) -> None:
        """The controller (re)admitted this agent: anything held under an earlier epoch was
        taken back by the controller, so it is forgotten here."""
        if self.epoch is not None and epoch != self.epoch:
            self._tasks.clear()
            self._by_worker.clear()
            for q in self._queues.values():
                q.clear()
        self.epoch = epoch
        self._out = Reports(epoch)

    # ---- from the controller ---------------------------------------------------------------

    def add_lease(self, grant: Any) -> int:
        """Queue a lease's tasks for this node's workers; the number queued. A grant of another
        epoch (sent to an earlier incarnation) is ignored: the controller took it back."""
        lease, epoch, stage, tasks, needs = _parse_grant(grant)
        if epoch != self.epoch:
            return 0
        q = self._queues.setdefault(stage, deque())
        for msg in tasks:
            if msg["task_id"] in self._tasks:
                raise MalformedLease(f"task {msg['task_id']} is held here already")
        for msg, need in zip(tasks, needs, strict=True):
            self._tasks[msg["task_id"]] = _Held(lease, msg, need)
            q.append(msg["task_id"])
        self._serve(stage)
        return len(tasks)

    def serving(self, worker: str, version: int) -> None:
        """``worker`` now serves policy ``version`` (its ``served`` report, or its version when
        admitted): its waiting polls get the tasks that version may run. A version never goes
        back: a late report of an older one changes nothing."""
        if version <= self._versions.get(worker, -1):
            return
        self._versions[worker] = version
        for got, stage in list(self._polls.get(worker, {}).items()):
            q = self._queues.get(stage)
            if not got.done() and q and (tid := self._first_for(q, version)) is not None:
                got.set_result(self._hand(worker, tid))  # its entry in the stage's line
                # of polls is dropped when the line reaches it

    # ---- from this node's workers ----------------------------------------------------------

    async def take(self, worker: str, stage: str, wait_s: float) -> m.TaskMsg | None:
        """A worker's long poll for a task of ``stage``: the next queued one; else it waits
        behind the stage's older polls for a task queued later, or None after ``wait_s``."""
        q = self._queues.get(stage)
        if q and (tid := self._first_for(q, self._versions.get(worker, 0))) is not None:
            return self._hand(worker, tid)
        waiting = self._waiting.setdefault(stage, deque())
        while waiting and waiting[0][1].done():  # expired since
            waiting.popleft()
        loop = asyncio.get_running_loop()
        got: asyncio.Future[m.TaskMsg | None] = loop.create_future()
        waiting.append((worker, got))
        mine = self._polls.setdefault(worker, {})
        mine[got] = stage
        expiry = loop.call_later(wait_s, _expire, got)
        try:
            return await got
        except asyncio.CancelledError:
            # Cancelled (the agent's server closes) after a task was handed to it: the task
            # goes back to the head of the queue, not to a worker that never receives it.
            msg = None if got.cancelled() else got.result()
            held = None if msg is None else self._release(worker, msg["task_id"])
            if held is not None:  # still its (not revoked meanwhile)
                held.worker = None
                self._tasks[held.msg["task_id"]] = held
                self._queues[stage].appendleft(held.msg["task_id"])
                self._serve(stage)
            raise
        finally:
            expiry.cancel()
            del mine[got]
            if not mine and self._polls.get(worker) is mine:
                del self._polls[worker]

    def _serve(self, stage: str) -> None:
        """Queued tasks of ``stage`` to its waiting polls, oldest poll first, each the oldest
        task its worker's version may run. A poll that may run none keeps its place."""
        q, waiting = self._queues.get(stage), self._waiting.get(stage)
        if not q or not waiting:
            return
        kept: deque[tuple[str, asyncio.Future[m.TaskMsg | None]]] = deque()
        least = min(self._tasks[t].need for t in q)  # only grows as tasks go: a safe bound
        while q and waiting:
            worker, got = waiting.popleft()
            if got.done():  # expired, or its poll cancelled
                continue
            version = self._versions.get(worker, 0)
            tid = self._first_for(q, version) if version >= least else None
            if tid is None:
                kept.append((worker, got))
            else:
                got.set_result(self._hand(worker, tid))
        waiting.extendleft(reversed(kept))

    def _first_for(self, q: deque[int], version: int) -> int | None:
        """Take the oldest queued task that a worker serving ``version`` may run, if any.
        Tasks queue in the order leased, the oldest steps first, so it is the head but for a
        task given back to the controller and leased again."""
        if self._tasks[q[0]].need <= version:
            return q.popleft()
        for i, tid in enumerate(q):
            if self._tasks[tid].need <= version:
                del q[i]
                return tid
        return None

    def _hand(self, worker: str, task_id: int) -> m.TaskMsg:
        held = self._tasks[task_id]
        held.worker = worker
        self._by_worker.setdefault(worker, {})[task_id] = None
        return held.msg

    def done(self, worker: str, report: m.DoneMsg) -> bool:
        """``worker`` completed a task: its report leaves with the next batch. False (and
        nothing changes) for a task that worker does not hold: a repeat, or a late one."""
        held = self._release(worker, report["task_id"])
        if held is None:
            return False
        self._out.done.append((held.lease, held.msg["rows"], report))
        self._out_event.set()
        return True

    def failed(self, worker: str, task_id: int) -> bool:
        """``worker`` could not run ``task_id``: it goes back to the controller."""
        held = self._release(worker, task_id)
        if held is None:
            return False
        self._give_back(held)
        return True

    def worker_gone(self, worker: str) -> list[int]:
        """``worker`` died or left: the tasks it held go back to the controller, and its polls
        still waiting end with none (a task queued later goes to another worker)."""
        for got in list(self._polls.get(worker, ())):
            _expire(got)
        self._versions.pop(worker, None)
        tids = list(self._by_worker.get(worker, ()))
        for tid in tids:
            self.failed(worker, tid)
        return tids

    def abandon(self) -> list[int]:
        """The agent stops: every queued task goes back to the controller (running ones are
        reported by their workers, or taken back with the agent's leases)."""
        tids = [tid for q in self._queues.values() for tid in q]
        for q in self._queues.values():
            q.clear()
        for tid in tids:
            self._give_back(self._tasks.pop(tid))
        return tids

    def revoked(self, lease: int) -> list[int]:
        """The controller took ``lease`` back (it expired there, or a renewal was refused): its
        tasks are forgotten here, queued or running, since their rows are the controller's
        again. A running one's report is then dropped here (the controller would refuse it)."""
        gone = [tid for tid, h in self._tasks.items() if h.lease == lease]
        for tid in gone:
            held = self._tasks.pop(tid)
            if held.worker is not None:
                mine = self._by_worker[held.worker]
                del mine[tid]
                if not mine:
                    del self._by_worker[held.worker]
        if gone:
            dead = set(gone)
            for q in self._queues.values():
                if any(t in dead for t in q):
                    kept = [t for t in q if t not in dead]
                    q.clear()
                    q.extend(kept)
        return gone

    # ---- to the controller -----------------------------------------------------------------

    def take_reports(self) -> Reports:
        """What to send the controller now (possibly nothing: then only the leases to renew)."""
        out, self._out = self._out, Reports(self._out.epoch)
        self._out_event.clear()
        out.held = sorted({h.lease for h in self._tasks.values()})
        return out

    async def reports(self, wait_s: float) -> Reports:
        """`take_reports` once there is something to report, or after ``wait_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._out_event.wait()
        return self.take_reports()

    # ---- views -----------------------------------------------------------------------------

    def queued(self, stage: str | None = None) -> int:
        if stage is not None:
            return len(self._queues.get(stage, ()))
        return sum(len(q) for q in self._queues.values())

    def running(self) -> int:
        return sum(len(t) for t in self._by_worker.values())

    # ---- internals -------------------------------------------------------------------------

    def _release(self, worker: str, task_id: Any) -> _Held | None:
        mine = self._by_worker.get(worker)
        if type(task_id) is not int or mine is None or task_id not in mine:
            return None
        del mine[task_id]
        if not mine:
            del self._by_worker[worker]
        return self._tasks.pop(task_id)

    def _give_back(self, held: _Held) -> None:
        self._out.given_back.append((held.lease, held.msg["task_id"]))
        self._out_event.set()


def _expire(got: asyncio.Future[m.TaskMsg | None]) -> None:
    """End a waiting poll with no task (its wait is over, or its worker gone)."""
    if not got.done():
        got.set_result(None)


def _parse_grant(grant: Any) -> tuple[int, int, str, list[m.TaskMsg], list[int]]:
    if not isinstance(grant, dict):
        raise MalformedLease(f"a lease grant is a mapping, got {type(grant).__name__}")
    lease, epoch, stage, tasks = (grant.get(k) for k in ("lease", "epoch", "stage", "tasks"))
    if type(lease) is not int or type(epoch) is not int or type(stage) is not str:
        raise MalformedLease("a lease grant names its 'lease', 'epoch' (integers) and 'stage'")
    if not isinstance(tasks, list) or not tasks:
        raise MalformedLease("a lease grant holds a non-empty list of 'tasks'")
    for t in tasks:
        if (not isinstance(t, dict) or type(t.get("task_id")) is not int
                or t.get("stage") != stage or not isinstance(t.get("rows"), list)):
            raise MalformedLease(f"a leased task must be a task message of stage {stage!r}")
    needs = grant.get("needs", [0] * len(tasks))
    if (not isinstance(needs, list) or len(needs) != len(tasks)
            or not all(type(v) is int and v >= 0 for v in needs)):
        raise MalformedLease("a lease grant's 'needs' lists one policy version (an integer "
                             ">= 0) per task")
    return lease, epoch, stage, tasks, needs


class DispatchApi:
    """The agent's calls for its node's workers, for the leased stages: ``get_task`` (with the
    previous task's report), ``task_done`` and ``task_failed``, in `flowrl.messages`' shapes,
    so a worker's runtime polls the agent as it would the controller. Only workers the
    controller told the agent of (`admit`: id, token and stage) are served, each call checked
    against the worker's token."""

    def __init__(self, dispatch: LocalDispatch) -> None:
        self.dispatch = dispatch
        self._workers: dict[str, tuple[bytes, str]] = {}  # id -> (token, stage)

    def admit(self, worker_id: str, token: bytes, stage: str, version: int = 0) -> None:
        """Serve ``worker_id`` (its token, its stage, the policy version it registered with)."""
        self._workers[worker_id] = (token, stage)
        self.dispatch.serving(worker_id, version)

    def served(self, worker_id: str, token: bytes, version: int) -> None:
        """A worker's ``served`` report (relayed by its node): tasks that need ``version`` may
        go to it now. Ignored unless it is from a worker served here, with its token."""
        known = self._workers.get(worker_id)
        if known is not None and hmac.compare_digest(token, known[0]):
            self.dispatch.serving(worker_id, version)

    def forget(self, worker_id: str) -> list[int]:
        """The worker is gone: the tasks it held go back to the controller."""
        self._workers.pop(worker_id, None)
        return self.dispatch.worker_gone(worker_id)

    def handlers(self) -> dict[str, Handler]:
        return {m.OP_GET_TASK: self._get_task, m.OP_TASK_DONE: self._task_done,
                m.OP_TASK_FAILED: self._task_failed}

    def _caller(self, p: Any) -> tuple[str, str]:
        """The worker a call is from, and its stage; PermissionError without its token."""
        wid = p.get("worker_id") if isinstance(p, dict) else None
        known = self._workers.get(wid) if type(wid) is str else None
        token = p.get("token") if isinstance(p, dict) else None
        if (known is None or type(token) is not bytes
                or not hmac.compare_digest(token, known[0])):
            raise PermissionError(f"no worker {wid!r} with that token on this node")
        assert type(wid) is str
        return wid, known[1]

    async def _get_task(self, p: Any, peer: bytes) -> m.TaskMsg | None:
        wid, stage = self._caller(p)
        wait_s = p.get("wait_s")
        if not (type(wait_s) in (int, float) and 0.0 <= wait_s <= MAX_WAIT_S):
            raise ValueError(f"'wait_s' must be a number of seconds in [0, {MAX_WAIT_S}]")
        done = p.get("done")
        if done is not None:
            self._report(wid, done)
        msg = await self.dispatch.take(wid, stage, float(wait_s))
        if msg is not None and wid not in self._workers:
            # The worker left while its poll waited here (a poll outlives its caller): the
            # task goes back rather than to no one.
            self.dispatch.failed(wid, msg["task_id"])
            return None
        return msg

    async def _task_done(self, p: Any, peer: bytes) -> dict[str, Any]:
        wid, _ = self._caller(p)
        return {"ok": self._report(wid, p)}

    async def _task_failed(self, p: Any, peer: bytes) -> dict[str, Any]:
        wid, _ = self._caller(p)
        return {"ok": self.dispatch.failed(wid, p.get("task_id"))}

    def _report(self, wid: str, done: Any) -> bool:
        # A repeat (the worker's poll carrying it failed) or a report of a task it does not
        # hold is dropped here; its content is checked by the controller, which fails the task
        # if it cannot take it.
        if not isinstance(done, dict) or done.get("worker_id") != wid:
            log.warning("ignored a malformed task report", report=repr(done)[:200])
            return False
        clean = {k: v for k, v in done.items() if k != "token"}
        return self.dispatch.done(wid, clean)  # type: ignore[arg-type]


Call = Callable[[str, dict[str, Any], float], Awaitable[Any]]
"""The agent's call at the controller: op, payload, how long it may wait; None once the
controller is gone (the agent then stops)."""


class AgentLink:
    """A node agent's node-local dispatch, joined to the run (`flowrl.node` hosts it): serves
    its node's leased workers' task calls on its own endpoint (`DispatchApi`), takes the
    controller's commands from a long poll (`OP_LEASE_POLL`) and sends its reports in batches
    (`OP_LEASE_REPORT`), whose reply names the leases it may no longer hold."""

    def __init__(self, node: str, call: Call, endpoint: str, epoch: int,
                 stages: dict[str, str], renew_s: float) -> None:
        self.node = node
        self.endpoint = endpoint
        self.stages = stages
        self.renew_s = renew_s
        self.dispatch = LocalDispatch(node)
        self.dispatch.joined(epoch)
        self.api = DispatchApi(self.dispatch)
        self._call_op = call

    async def _call(self, op: str, payload: dict[str, Any], wait_s: float) -> Any:
        """``op`` at the controller; its refusal is logged and returned, not raised (the agent's
        other duties go on)."""
        try:
            return await self._call_op(op, payload, wait_s)
        except RemoteError as exc:
            log.warning("the controller refused a lease call", op=op, node=self.node,
                        error=str(exc)[:300])
            return exc

    @classmethod
    async def join(cls, node: str, call: Call, endpoint: str) -> AgentLink | None:
        """Join the run's node-local dispatch; None when the run dispatches centrally (the
        controller does not know the op) or is gone."""
        try:
            reply = await call(OP_LEASE_JOIN, {"node": node}, 0.0)
        except UnknownOperation:
            return None
        except RemoteError as exc:  # this node runs no leased workers
            log.info("node dispatch off here", node=node, why=str(exc)[:200])
            return None
        if not isinstance(reply, dict):
            return None
        stages: Any = reply.get("stages")
        epoch: Any = reply.get("epoch")
        renew_s: Any = reply.get("renew_s")
        if (not isinstance(stages, dict) or type(epoch) is not int
                or type(renew_s) not in (int, float) or not 0 < renew_s <= MAX_WAIT_S):
            raise MalformedLease(f"a malformed lease_join reply: {reply!r:.200}")
        return cls(node, call, endpoint, epoch, {str(k): str(v) for k, v in stages.items()},
                   float(renew_s))

    def tasks_endpoint(self, role: str) -> str | None:
        """Where a worker of ``role`` on this node polls for tasks (None: the controller)."""
        return self.endpoint if role in self.stages else None

    async def run(self) -> None:
        """Serve until cancelled (the agent stops)."""
        server = RpcServer(self.endpoint, self.api.handlers(), long_polls={m.OP_GET_TASK},
                           tensors=False)
        await server.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._commands())
                tg.create_task(self._reports())
        finally:
            await server.aclose()

    async def _commands(self) -> None:
        wait_s = 2.0
        while True:
            reply = await self._call(OP_LEASE_POLL, {"node": self.node,
                                                     "epoch": self.dispatch.epoch,
                                                     "wait_s": wait_s}, wait_s)
            if reply is None:
                return
            if isinstance(reply, RemoteError):
                await asyncio.sleep(1.0)  # a refusal (logged): ask again, a little later
                continue
            self.apply(reply)

    def apply(self, reply: Any) -> None:
        """The controller's commands: workers admitted, leases granted and revoked, workers
        forgotten (their tasks given back)."""
        if not isinstance(reply, dict):
            log.warning("ignored malformed lease commands", node=self.node)
            return
        for cmd in reply.get("admit", ()):
            wid, token, stage = (cmd.get(k) for k in ("worker_id", "token", "stage"))
            version = cmd.get("version", 0)
            if (type(wid) is str and type(token) is bytes and type(stage) is str
                    and type(version) is int):
                self.api.admit(wid, token, stage, version)
        for grant in reply.get("grant", ()):
            try:
                self.dispatch.add_lease(grant)
            except MalformedLease as exc:
                log.warning("ignored a malformed lease", node=self.node, error=str(exc))
        for lease in reply.get("revoke", ()):
            if type(lease) is int:
                self.dispatch.revoked(lease)
        for wid in reply.get("forget", ()):
            if type(wid) is str:
                self.api.forget(wid)

    async def _reports(self) -> None:
        while True:
            reports = await self.dispatch.reports(self.renew_s)
            reply = await self._call(OP_LEASE_REPORT,
                                     {"node": self.node, **reports.to_wire()}, 0.0)
            if reply is None:
                return
            if isinstance(reply, RemoteError):
                # The batch is lost; its leases expire at the controller and come back.
                await asyncio.sleep(1.0)
                continue
            for lease in reply.get("revoked", ()) if isinstance(reply, dict) else ():
                if type(lease) is int:
                    self.dispatch.revoked(lease)
