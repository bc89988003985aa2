"""The workforce: the run's worker processes, here and on other nodes.

It starts every pool's processes, watches them, and brings them back:

- a process that **exits** unexpectedly is started again after a backoff that doubles from
  ``restart_backoff_s`` (capped at `MAX_RESTART_BACKOFF_S`), at most ``max_restarts`` times
  per process; one more death ends the run with the process's last error (what it reported,
  else the last error it logged or the traceback it printed);
- a process that **cannot start** (its model, dataset or reward function fails to load) says
  so before it exits (``start_failed``): if it never came up, it would fail the same way
  again, so the run ends at once with its error; a restarted one is restarted within the same
  budget;
- a worker that **misses heartbeats** (stopped, or its event loop blocked by user code) is
  removed at once (its tasks are redone elsewhere) and its process is killed, since it may well
  be alive, and then restarted like a dead one, within the same budget;
- **data-parallel trainer ranks** restart as one group: a rank cannot rejoin a running group,
  so the others are killed (through their agents on other nodes), and all start again in a
  fresh rendezvous (`generation`).

Which worker ids a process hosted is the registry's business; this part speaks of processes
(``role.proc_no``) and tells the controller which workers went down through ``worker_gone``.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import secrets
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import structlog

from flowrl.events import EventBus
from flowrl.node_hub import NODE_TOKEN_ENV, NodeHub, relay_heartbeat_s, relay_renew_s
from flowrl.pipeline import PipelineSpec, PoolSpec
from flowrl.procs import Child, Supervisor
from flowrl.registry import Registry, WorkerInfo
from flowrl.rendezvous import RankRendezvous
from flowrl.worker_launch import engine_config_of_group, process_spec, worker_command
from flowrl.worker_spec import Endpoints as WorkerEndpoints
from flowrl.worker_spec import WorkerSpec
from transport.endpoints import ipc_endpoint
from transport.pubsub import DroppedSubscriber
from transport.rpc import Handler

__all__ = ["MAX_RESTART_BACKOFF_S", "TRAIN_GROUP", "Endpoints", "Workforce"]

log = structlog.get_logger("flowrl.controller")

#: the longest wait before a dead worker process is restarted
MAX_RESTART_BACKOFF_S = 30.0
#: the restart counter's (and restart queue's) name for the data-parallel trainer group
TRAIN_GROUP = "train ranks"


@dataclass
class Endpoints:
    """Where this node's workers reach the controller, its broadcasts and the node store."""

    controller: str = ""
    broadcast: str = ""
    store: str = ""
    #: where workers send ``served`` (their node agent's relay); "": to the controller
    relay: str = ""


@dataclass(frozen=True)
class _Process:
    role: str
    proc_no: int
    count: int
    capacity: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.role}.{self.proc_no}"


@dataclass
class _RemoteExit:
    """What `Workforce.on_child_exit` reads of a child, for a process on another node."""

    name: str
    pid: int = -1
    #: the controller had it killed (a data-parallel group's restart)
    expected_exit: bool = False
    #: it had registered workers (`on_remote_exit` has reported them gone)
    registered: bool = False
    #: the last error it logged or printed, as its agent saw it
    last_error: str = ""


def rank_rendezvous(spec: PipelineSpec, hub: NodeHub | None, ranked: bool,
                    train_pool: PoolSpec | None) -> RankRendezvous | None:
    """Where data-parallel ranks on several nodes meet (None: in a file of their node's run
    directory, or no ranks at all)."""
    if not ranked or train_pool is None or len(set(train_pool.nodes)) <= 1:
        return None
    assert hub is not None  # made whenever a pool names another node
    if hub.config.trainer_rendezvous != "cluster":
        raise ValueError(
            f"data-parallel trainer ranks placed on nodes {sorted(set(train_pool.nodes))} "
            "cannot meet in one node's run directory; ClusterConfig(trainer_rendezvous="
            "'cluster') (recipe: placement.cluster.trainer_rendezvous) lets them meet "
            "in a store this controller hosts (unauthenticated and unencrypted, as every "
            "torch.distributed link: trusted fabrics only)")
    section = spec.engine_config.get("data_parallel") or {}
    return RankRendezvous(hub.config.host, timeout_s=float(section.get("timeout_s", 600.0)))


class Workforce:
    def __init__(self, spec: PipelineSpec, *, run_id: str, node: str, registry: Registry,
                 events: EventBus, hub: NodeHub | None, rendezvous: RankRendezvous | None,
                 train_role: str | None, ranked: bool,
                 worker_gone: Callable[[str, str], None],
                 fail_run: Callable[[str], None],
                 stopping: Callable[[], bool]) -> None:
        """``ranked``: the train role runs as data-parallel ranks; ``worker_gone(worker_id,
        why)``: forget a worker and redo its tasks; ``fail_run(error)``: end the run;
        ``stopping()``: the controller is closing (exits are expected)."""
        self.spec = spec
        self.run_id = run_id
        self.node = node
        self.registry = registry
        self.events = events
        self.hub = hub
        self.rendezvous = rendezvous
        self.train_role = train_role
        self.ranked = ranked
        self.endpoints = Endpoints()
        self._worker_gone = worker_gone
        self._fail_run = fail_run
        self._stopping = stopping
        self.supervisor = Supervisor(self.on_child_exit)
        self._processes: dict[str, _Process] = {}
        self._restarts: collections.Counter[str] = collections.Counter()
        #: restarts done (the status and the summary show it)
        self.restarts = 0
        #: restarts of the data-parallel trainer group; it meets anew each time
        self.generation = 0
        #: set from a rank's death until the whole group has been started again: the other
        #: ranks going down meanwhile are part of the same restart.
        self._group_restarting = False
        #: processes killed for missing heartbeats: their exit is a death, not an order
        self._hung: set[str] = set()
        #: the error a worker process reported (or why it was killed) before its exit, by
        #: process name; its exit takes it (with the process's last logged error as fallback)
        self.last_error: dict[str, str] = {}
        #: what each process reports a failed start with (`start_failed`), by process name
        self._start_tokens: dict[str, str] = {}
        # bounded by the number of worker processes (one pending restart each)
        self._restart_q: asyncio.Queue[tuple[str, float]] = asyncio.Queue()

    # ---- starting --------------------------------------------------------------------------

    async def open_nodes(self, handlers: dict[str, Handler]) -> Coroutine[Any, Any, None]:
        """Listen for the other nodes' agents (serving them ``handlers``); returns the hub's
        loop, for the controller to own. Starts the ranks' cross-node rendezvous, if any."""
        hub = self.hub
        assert hub is not None
        await hub.start(handlers)
        log.info("listening for node agents", endpoint=hub.endpoint, nodes=hub.nodes,
                 **({} if hub.config.keys_file is None else {"keys_file": hub.config.keys_file}))
        if self.rendezvous is not None:
            log.warning("trainer ranks meet across nodes in an unauthenticated store; their "
                        "collectives are unencrypted", store=self.rendezvous.start())
        return hub.run()

    async def start_node_agent(self, token: bytes) -> None:
        """This node's agent: it owns the node's sample store (and serves it to the other
        nodes' workers when there are any), relays the controller's broadcasts to this node's
        workers and gathers their ``served`` reports (signed with ``token``), and reports
        ``node_up`` once it listens."""
        hub = self.hub
        peer_store = [] if hub is None else hub.store_args()
        env = {} if hub is None else hub.keys.to_env()
        await self.supervisor.spawn(
            f"node:{self.node}",
            [sys.executable, "-m", "flowrl.node", "--run-id", self.run_id, "--node", self.node,
             "--controller", self.endpoints.controller, "--broadcast", self.endpoints.broadcast,
             "--heartbeat-s", str(relay_heartbeat_s(self.spec.heartbeat_s)),
             "--renew-s", str(relay_renew_s(self.spec.heartbeat_timeout_s)),
             "--store", ipc_endpoint(self.run_id, f"store-{self.node}"),
             "--capacity", str(self.spec.store_capacity_bytes), *peer_store],
            env={**env, NODE_TOKEN_ENV: token.hex()})

    async def start_pools(self) -> None:
        for pool in self.spec.pools:
            if self.spec.colocated and pool.role == "rollout":
                continue  # hosted by the train processes (`worker_launch.process_spec`)
            procs = -(-pool.count // pool.per_process)
            for p in range(procs):
                count = min(pool.per_process, pool.count - p * pool.per_process)
                await self._spawn(_Process(pool.role, p, count, pool.capacity, pool.threads))

    async def wait_registered(self, registered: asyncio.Event, timeout_s: float, *,
                              failed: Callable[[], BaseException | None]) -> None:
        """Until every pool's workers registered (``registered`` is set at each registration);
        raises what ``failed()`` returns once set, and TimeoutError naming who is missing."""
        expected = sum(p.count for p in self.spec.pools)
        try:
            async with asyncio.timeout(timeout_s):
                while len(self.registry) < expected:
                    # Checked first too: a process may fail to start before this wait begins.
                    if (error := failed()) is not None:
                        raise error
                    registered.clear()
                    await registered.wait()
        except TimeoutError:
            have = collections.Counter(w.role for w in self.registry.all())
            missing = {p.role: p.count - have[p.role] for p in self.spec.pools
                       if have[p.role] < p.count}
            raise TimeoutError(f"workers did not register within {timeout_s}s: "
                               f"missing {missing}") from None

    async def _spawn(self, proc: _Process) -> Child | None:
        """Start ``proc`` on its node: here as a child, elsewhere through that node's agent."""
        self._processes[proc.name] = proc
        node = self.node_of(proc.role, proc.proc_no)
        token = self._start_tokens[proc.name] = secrets.token_hex(16)
        process = process_spec(self.spec, role=proc.role, proc_no=proc.proc_no,
                               count=proc.count, capacity=proc.capacity, threads=proc.threads,
                               engine_config=self.engine_config(), start_token=token)
        hub = self.hub
        if node != self.node:
            assert hub is not None  # made whenever a pool names another node
            hub.spawn(node, process)
            return None
        e = self.endpoints
        argv = worker_command(WorkerSpec(process=process, endpoints=WorkerEndpoints(
            run_id=self.run_id, node=self.node, controller=e.controller,
            broadcast=e.broadcast, store=e.store, relay=e.relay,
            peers={} if hub is None else hub.peers_for(self.node))))
        return await self.supervisor.spawn(process.name, argv,
                                           env=None if hub is None else hub.keys.to_env())

    def node_of(self, role: str, proc_no: int) -> str:
        """The node worker process ``proc_no`` of `role` runs on (its pool's nodes in turn)."""
        pool = self.spec.pool(role)
        return pool.nodes[proc_no % len(pool.nodes)] if pool and pool.nodes else self.node

    def engine_config(self) -> dict[str, Any]:
        """What worker processes are configured with: the spec's, plus, for data-parallel
        trainer ranks, the generation of a restarted group (its ranks meet in a fresh
        rendezvous) and the store that ranks on several nodes meet in."""
        return engine_config_of_group(
            self.spec.engine_config, generation=self.generation,
            store=None if self.rendezvous is None else self.rendezvous.address)

    # ---- deaths ----------------------------------------------------------------------------

    def start_failed(self, name: str, token: str, error: str) -> None:
        """Worker process ``name`` could not start and exits next. One that never came up
        (its first start; a rank's, of the group's first start) would fail the same way
        again: the run ends with its error. A restarted one is restarted again (its exit
        counts against ``max_restarts``) and its error is kept for the message. Raises
        PermissionError for a report without the token of the process's current start."""
        expected = self._start_tokens.get(name)
        if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
            raise PermissionError(f"a start_failed report for {name!r} without its start token")
        log.error("worker process failed to start", process=name, error=error)
        self.last_error[name] = error
        first = self.generation == 0 if self._is_rank(name) else not self._restarts[name]
        if first and not self._stopping():
            self._fail_run(f"worker process {name} failed to start: {error}")

    def on_remote_exit(self, node: str, name: str, pid: int, code: int, expected: bool,
                       error: str = "") -> None:
        """A worker process on another node exited (``error``: the last error it logged or
        printed there): as `on_child_exit` for a child here."""
        gone = [info for info in self.registry.all() if info.node == node and info.pid == pid]
        for info in gone:
            self._worker_gone(info.worker_id, f"process {pid} on {node} exited with {code}"
                                              f"{': ' + error if error else ''}")
        # pid -1 matches no worker here (pids of different nodes may coincide).
        self.on_child_exit(cast(Child, _RemoteExit(name, expected_exit=expected,
                                                   registered=bool(gone), last_error=error)),
                           code)

    def on_child_exit(self, child: Child, code: int) -> None:
        if child.name.startswith("node:") and not self._stopping():
            last = child.last_error
            self._fail_run(f"node agent {child.name} exited with code {code}"
                           f"{': ' + last if last else ''}")
            return
        # What it reported, else the last error it logged or the traceback it printed.
        last = self.last_error.pop(child.name, "") or child.last_error
        exited = f"exited with code {code}{': ' + last if last else ''}"
        registered = self.registry.by_pid(child.pid)
        for info in registered:
            self._worker_gone(info.worker_id, f"process {child.pid} {exited}")
        hung = child.name in self._hung
        self._hung.discard(child.name)
        if (self._stopping() or (child.expected_exit and not hung)
                or child.name not in self._processes):
            return
        if self._is_rank(child.name):
            # The group is restarted as a whole; a registered rank's going was reported
            # (worker_gone), one that died before registering is reported here, or the
            # group would wait for it forever.
            if not registered and not (isinstance(child, _RemoteExit) and child.registered):
                self.group_down(child.name, f"its process {exited} before it registered")
            return
        n = self._restarts[child.name] = self._restarts[child.name] + 1
        if n > self.spec.max_restarts:
            self._fail_run(
                f"worker process {child.name} died {n} times (last exit code {code}"
                f"{': ' + last if last else ''}); max_restarts is {self.spec.max_restarts}")
            return
        delay = self.restart_delay(n)
        log.warning("restarting worker process", process=child.name, attempt=n, delay_s=delay)
        self._restart_q.put_nowait((child.name, delay))

    def hung(self, info: WorkerInfo) -> None:
        """``info`` missed its heartbeats (the registry no longer has it): kill its process,
        which may be alive but stopped or stuck, so that it is restarted like a dead one."""
        name = info.process
        if name not in self._processes or self._stopping():
            return
        self.last_error.setdefault(name, "missed heartbeats")
        if info.node != self.node:
            if self.hub is not None:
                self._hung.add(name)
                asyncio.get_running_loop().create_task(
                    self._kill_remote(info.node, name), name=f"flowrl-kill-{name}")
            return
        for child in self.supervisor.children:
            if child.pid == info.pid:
                self._hung.add(name)
                self.supervisor.kill(child.pid, signal.SIGKILL)

    def subscriber_dropped(self, dropped: DroppedSubscriber, node: str | None = None) -> None:
        """A broadcast subscriber stopped reading: a worker that is still connected (each
        worker subscribes under its own name) is hung, and is treated like one that missed
        its heartbeats. ``node``: the node whose agent's relay dropped it (its workers only)."""
        log.warning("broadcast subscriber dropped", subscriber=dropped.name,
                    reason=dropped.reason, connected=dropped.connected, node=node)
        if not dropped.connected or self._stopping():
            return
        for info in self.registry.all():
            if info.name == dropped.name and node in (None, info.node):
                self._worker_gone(info.worker_id,
                                  f"stopped reading broadcasts ({dropped.reason})")
                self.hung(info)

    def node_lost(self, node: str) -> str | None:
        """``node``'s agent was lost, and its worker processes with it (they die with their
        agent): they are not restarted, the node is out of the run. Returns why the run cannot
        go on without them (None: it can)."""
        gone = {name: p for name, p in self._processes.items()
                if self.node_of(p.role, p.proc_no) == node}
        for name in gone:
            del self._processes[name]
            self._hung.discard(name)
        trainers = sorted(n for n, p in gone.items() if p.role == self.train_role)
        if trainers:
            return (f"trainer process(es) {trainers} ran there: the trainer's state is lost "
                    "(resume the run from its last checkpoint)")
        left = {p.role for p in self._processes.values()}
        if self.spec.colocated and self.train_role in left:
            left.add("rollout")  # hosted by the train processes
        empty = sorted({p.role for p in gone.values()} - left)
        if empty:
            return f"no {', '.join(empty)} worker is left on any other node"
        if gone:
            log.warning("worker processes lost with their node", node=node,
                        processes=sorted(gone))
        return None

    async def _kill_remote(self, node: str, name: str) -> None:
        assert self.hub is not None
        try:
            await self.hub.stop_workers(node, [name])
        except TimeoutError:
            self._fail_run(f"the agent of node {node!r} did not confirm that hung worker "
                           f"process {name} is gone")

    def group_down(self, rank: str, why: str) -> None:
        """Data-parallel trainer ``rank`` (a worker or its process, by name) went down or failed
        a micro-batch. The others cannot step without it and a rank cannot rejoin a running
        group, so the whole group is restarted (its step redone, every rank loading the current
        version), counted against ``max_restarts``."""
        if self._group_restarting:
            return  # another rank of a group already being restarted
        dead = self._dead_rank()
        if dead is not None and dead != rank and not rank.startswith(dead + "."):
            # A peer's death makes the survivors' collectives fail, and a survivor's failed
            # micro-batch may be heard of before the death itself: the dead rank is the cause.
            why = f"its process exited; rank {rank} then failed: {why}"
            name = dead
        else:
            name = rank
        n = self._restarts[TRAIN_GROUP] = self._restarts[TRAIN_GROUP] + 1
        if n > self.spec.max_restarts:
            self._fail_run(
                f"data-parallel trainer rank {name} went down ({why}) and the group is not "
                f"restarted: the group was restarted {n - 1} times; max_restarts is "
                f"{self.spec.max_restarts}. Resume the run from its last checkpoint")
            return
        self._group_restarting = True
        self.generation += 1
        delay = self.restart_delay(n)
        log.warning("restarting the data-parallel trainer group", rank=name, why=why,
                    attempt=n, delay_s=delay)
        self._restart_q.put_nowait((TRAIN_GROUP, delay))

    def _dead_rank(self) -> str | None:
        """The process name of a rank here that has exited, whether or not its exit has been
        handled yet (ranks on other nodes are known only once their agent reports them)."""
        for child in self.supervisor.children:
            if self._is_rank(child.name) and self.supervisor.exited(child.pid):
                return child.name
        return None

    def restart_delay(self, n: int) -> float:
        """The wait before restart ``n`` (1-based): doubling from ``restart_backoff_s``, capped
        (with a high max_restarts, doubling alone would reach hours)."""
        return min(self.spec.restart_backoff_s * 2.0 ** (n - 1), MAX_RESTART_BACKOFF_S)

    def _is_rank(self, name: str) -> bool:
        return self.ranked and name.rpartition(".")[0] == self.train_role

    # ---- restarting ------------------------------------------------------------------------

    async def restart_loop(self) -> None:
        """Restarts dead worker processes, each after its own backoff (processes killed
        together come back together; bounded by ``max_restarts``)."""
        async with asyncio.TaskGroup() as tg:  # cancelled with the controller: so are these
            while True:
                name, delay = await self._restart_q.get()
                tg.create_task(self._restart(name, delay), name=f"flowrl-restart-{name}")

    async def _restart(self, name: str, delay: float) -> None:
        if name == TRAIN_GROUP:
            await self._restart_group(delay)
            return
        await asyncio.sleep(delay)  # backoff timer, not a poll
        proc = self._processes.get(name)
        if self._stopping() or proc is None:  # None: its node was lost meanwhile
            return
        try:
            await self._spawn(proc)
        except Exception as exc:  # a process that cannot start again ends the run, loudly
            self._fail_run(f"could not restart worker process {name}: {exc!r}")
            return
        self.restarts += 1
        self.events.emit("worker_restart", process=name)

    async def _restart_group(self, delay: float) -> None:
        """Stop every rank process still running (a broken group cannot recover), here and,
        through their agents, on other nodes; wait out the backoff, start all ranks again."""
        ranks = sorted((p for p in self._processes.values() if self._is_rank(p.name)),
                       key=lambda p: p.proc_no)
        elsewhere: dict[str, list[str]] = {}
        for p in ranks:
            node = self.node_of(p.role, p.proc_no)
            if node != self.node:
                elsewhere.setdefault(node, []).append(p.name)
        await self.supervisor.stop_all(0.0, only=lambda c: self._is_rank(c.name),
                                       signals=(signal.SIGKILL,))
        if elsewhere:
            hub = self.hub
            assert hub is not None  # made whenever a pool names another node
            try:
                await asyncio.gather(*(hub.stop_workers(node, names)
                                       for node, names in elsewhere.items()))
            except TimeoutError:
                self._fail_run(
                    f"could not restart the data-parallel trainer group: the agents of "
                    f"{sorted(elsewhere)} did not confirm that its ranks there are gone")
                return
        await asyncio.sleep(delay)  # backoff timer, not a poll
        if self._stopping():
            return
        try:
            for p in ranks:
                await self._spawn(p)
        except Exception as exc:  # a group that cannot start again ends the run, loudly
            self._fail_run(f"could not restart the data-parallel trainer group: {exc!r}")
            return
        self._group_restarting = False
        self.restarts += 1
        self.events.emit("worker_restart", process=TRAIN_GROUP)

    # ---- liveness --------------------------------------------------------------------------

    async def watchdog(self, now: Callable[[], float]) -> None:
        """Declares workers that missed their heartbeats down, and has their processes
        killed and restarted (`hung`)."""
        while True:
            deadline = self.registry.next_deadline()
            delay = self.spec.heartbeat_timeout_s if deadline is None else deadline - now()
            await asyncio.sleep(max(0.0, delay) + 0.001)
            for info in self.registry.expired(now()):
                self._worker_gone(info.worker_id, "missed heartbeats")
                self.hung(info)

    # ---- stopping --------------------------------------------------------------------------

    async def stop(self) -> None:
        """Workers leave on the stop broadcast; the node agent (which owns shared memory that
        workers may still be reading) is asked to go only once they are gone."""
        await self.supervisor.stop_all(grace_s=5.0, only=lambda c: not c.name.startswith("node:"))
        await self.supervisor.stop_all(grace_s=0.0)

    def kill(self, pid: int) -> None:
        """SIGKILL one child (tests and chaos use this)."""
        self.supervisor.kill(pid)
