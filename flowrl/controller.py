"""The controller: one asyncio process that streams micro-batches between stages.

It owns the metadata index, the worker registry, the staleness gate and the policy version; it
never touches sample tensors, only their handles. Workers pull tasks with long polls; every
reply that changes the index (a task done or failed, a worker up or down, a new version) wakes the
scheduler, which dispatches whatever became possible — no loop ever sleeps to poll.

Guarantees (the index guarantees the rest):

- a row is trained at most once, and only by an optimizer step that completed: the train
  micro-batches of a step are committed to the index when the step ends, and a trainer that dies
  mid-step gives all of that step's rows back;
- a train step at trainer version ``v`` only takes rows generated at version ``>= v -
  max_staleness`` (staler rows are dropped and counted); with ``max_staleness = 0`` it is exactly
  synchronous on-policy training;
- a dead worker (process exit or missed heartbeats) has its tasks failed at once, so their rows
  are redone by others;
- with data-parallel trainer ranks (`flowrl.dp`) every rank gets a token-balanced share of every
  step and exactly one step end; the step commits once all ranks reported it and agree on their
  parameters. A rank that dies or fails a micro-batch takes the group down: every rank is
  started again (`_train_group_down`) and the step redone, within ``max_restarts``.

Bounds: a worker holds at most ``capacity + prefetch`` assigned tasks; admission holds at most
``(max_staleness + 1) * groups_per_step`` groups ahead of the trainer, and admits groups for
later steps than the next only while the sample store has room for them under
``store_high_water`` (`flowrl.backpressure`); a run stuck on a store too small for one step
stops with an error naming the capacity instead of waiting.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog

from flowrl import messages as m
from flowrl.backpressure import StoreBackpressure
from flowrl.dp import RankShares, StepDivergence, merge_step_ends
from flowrl.events import EventBus, Span
from flowrl.graph import StageSpec
from flowrl.index import Index, Task
from flowrl.node import ClusterConfig, NodeHub, StoreRouter
from flowrl.pipeline import PipelineSpec
from flowrl.procs import Child, Supervisor
from flowrl.registry import Registry, WorkerInfo
from flowrl.rendezvous import RankRendezvous
from flowrl.resume import RunState, TrainedPositions, write_state
from flowrl.staleness import StalenessGate
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir
from transport.handles import Handle, is_handle
from transport.pubsub import Publisher
from transport.rpc import Handler, RpcClient, RpcServer
from transport.shm import claim_run_dir

if TYPE_CHECKING:
    from pydantic import SecretStr

    from flowrl.monitor import LoopLag, MonitorServer
    from flowrl.recipe import MonitorConfig

log = structlog.get_logger("flowrl.controller")


class RunError(RuntimeError):
    """The run cannot go on (e.g. a pool has no live worker left and cannot be restarted)."""


@dataclass
class _RemoteExit:
    """What `Controller._on_child_exit` reads of a child, for a process on another node."""

    name: str
    pid: int = -1
    #: the controller had it killed (a data-parallel group's restart)
    expected_exit: bool = False


@dataclass
class _Assigned:
    task: Task
    worker: str
    params: dict[str, Any]
    ready_at: float
    started_at: float = 0.0


class Controller:
    """Async context manager: ``async with Controller(spec) as ctl: await ctl.run(steps=5)``."""

    def __init__(
        self, spec: PipelineSpec, *, run_id: str | None = None, node: str = "node0",
        start_timeout_s: float = 120.0, monitor: MonitorConfig | None = None,
        cluster: ClusterConfig | None = None, resume: RunState | None = None,
    ) -> None:
        self.spec = spec
        self.graph = spec.graph()
        self.run_id = run_id or new_run_id()
        self.node = node
        self.start_timeout_s = start_timeout_s
        self.index = Index(self.graph)
        self.registry = Registry(spec.heartbeat_timeout_s, tasks_per_slot=1 + spec.prefetch)
        self.gate = StalenessGate(spec.max_staleness, spec.groups_per_step)
        self.version = 0
        self._source_stage = self._find_source_stage()
        self._train_stage = next(
            (s for s in self.graph.order if s.consumes_version_bound), None)
        self._assigned: dict[int, _Assigned] = {}
        self._queues: dict[str, asyncio.Queue[m.TaskMsg]] = {}
        self._group_step: dict[int, int] = {}
        self._group_pos: dict[int, int] = {}  # group id -> its dataset position
        self._trained_pos = TrainedPositions()
        # Positions to admit before new ones: given back by stale drops, or in flight when the
        # checkpoint being resumed was taken.
        self._redo: collections.deque[int] = collections.deque()
        self._admitted = 0
        self._data_pos = 0  # the next new dataset position
        self._train_step = 0  # step the next train micro-batch belongs to
        self._step_attempt = 0  # bumped whenever a step's micro-batches are given back
        self._train_groups_in_step = 0
        self._step_tasks: list[int] = []  # train tasks done but not yet committed
        # other stages' task metrics since the last step commit (see `_fold_metrics`)
        self._stage_metrics: dict[str, float] = {}
        train_pool = spec.pool(self._train_stage.role) if self._train_stage else None
        #: how a step is shared among data-parallel trainer ranks (None: one trainer).
        self._dp: RankShares[Task] | None = None
        if self._train_stage is not None and train_pool is not None and train_pool.count > 1:
            if train_pool.per_process != 1:
                raise ValueError("data-parallel trainer ranks need a process each "
                                 f"(per_process=1), got per_process={train_pool.per_process}")
            self._dp = RankShares(train_pool.count, spec.groups_per_step,
                                  self._train_stage.micro_batch)
        #: restarts of the data-parallel trainer group; it meets anew each time (`flowrl.dp`)
        self._dp_generation = 0
        #: set from a rank's death until the whole group has been started again: the other
        #: ranks going down meanwhile are part of the same restart.
        self._dp_restarting = False
        #: step -> (its train tasks done, its ranks' step-end reports), until it commits.
        self._dp_done: dict[int, tuple[list[int], list[dict[str, Any]]]] = {}
        self._assigned_done: dict[int, Task] = {}
        self._weights: dict[int, dict[str, Any]] = {}
        self._running = False  # a run() is in progress
        self._dispatching = False  # a dispatch pass is on the stack (no re-entry)
        self._changed = asyncio.Event()
        self._failures: collections.Counter[tuple[str, int]] = collections.Counter()
        self._kick_at = 0.0
        self._stop = asyncio.Event()
        self._steps_target = 0
        self._steps_done_evt = asyncio.Event()
        self._registered = asyncio.Event()
        self._node_up = asyncio.Event()
        self._store_endpoint = ""
        self._endpoint = ""
        self._broadcast = ""
        self._fatal: BaseException | None = None
        # Unbounded, but bounded in practice: frees follow retirements (at most the rows the
        # staleness gate admitted) and broadcasts follow steps.
        self._free_q: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._pub_q: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        # bounded by the number of worker processes (one pending restart each)
        self._restart_q: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
        self._worker_procs: dict[str, tuple[str, int, int, int, int]] = {}
        self._restarts: collections.Counter[str] = collections.Counter()
        self.restarts = 0
        self._last_step_at = 0.0
        self.events = EventBus()
        #: the node store's accounting, refreshed after every batch of frees, while admission
        #: waits for the store, and when the run has been quiet for `_STORE_CHECK_S`.
        self.store_stats: dict[str, Any] = {}
        self._store_bp = StoreBackpressure(high_water=spec.store_high_water,
                                           groups_per_step=spec.groups_per_step)
        self._store_stats_wanted = False  # a refresh is queued in `_free_q`
        #: called with each step's metrics (the launcher prints them, the monitor streams them).
        self.on_step: list[Callable[[dict[str, Any]], None]] = []
        self._supervisor = Supervisor(self._on_child_exit)
        self._owned: list[asyncio.Task[None]] = []
        self._server: RpcServer | None = None
        self._pub: Publisher | None = None
        self._store: RpcClient | None = None
        # Nodes other than this one (pools placed there): their agents meet us at `nodes`.
        remote = {n for p in spec.pools for n in p.nodes} - {node}
        self._hub = None if not remote else NodeHub(
            self.run_id, remote, cluster or ClusterConfig(),
            capacity=spec.store_capacity_bytes, on_lost=self._on_node_lost,
            on_exit=self._on_remote_exit)
        #: where data-parallel ranks on several nodes meet (None: in a file of their node's run
        #: directory, or no ranks at all)
        self._rendezvous: RankRendezvous | None = None
        if self._dp is not None and train_pool is not None and len(set(train_pool.nodes)) > 1:
            assert self._hub is not None  # made whenever a pool names another node
            if self._hub.config.trainer_rendezvous != "cluster":
                raise ValueError(
                    f"data-parallel trainer ranks placed on nodes {sorted(set(train_pool.nodes))} "
                    "cannot meet in one node's run directory; ClusterConfig(trainer_rendezvous="
                    "'cluster') (recipe: placement.cluster.trainer_rendezvous) lets them meet "
                    "in a store this controller hosts (unauthenticated and unencrypted, as every "
                    "torch.distributed link: trusted fabrics only)")
            section = spec.engine_config.get("data_parallel") or {}
            self._rendezvous = RankRendezvous(
                self._hub.config.host, timeout_s=float(section.get("timeout_s", 600.0)))
        # accounting
        self.rows_trained = 0
        self.rows_trained_twice = 0
        self.stale_dropped = 0
        self.dispatch_us: collections.deque[float] = collections.deque(maxlen=100_000)
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        #: the last error a worker process reported before dying, by process name.
        self._last_error: dict[str, str] = {}
        self.step_log: list[dict[str, Any]] = []
        self.worker_deaths = 0
        self._t0 = 0.0
        self._samples_trained = 0
        # control (the monitor's POST endpoints call these)
        self._paused = False
        self._drained_sent = False
        #: the HTTP monitor's settings; None runs no monitor.
        self.monitor_config = monitor
        self._monitor: MonitorServer | None = None
        self._lag: LoopLag | None = None
        if resume is not None:
            self._resume_from(resume)

    def _resume_from(self, state: RunState) -> None:
        """Continue after `state`'s version: its trained positions are never admitted again,
        the ones it had in flight are admitted first. Workers are started at that version
        from its checkpoint (see `flowrl.run.compile_recipe`)."""
        self.version = self._train_step = state.version
        self._admitted = state.version * self.spec.groups_per_step
        self._trained_pos = TrainedPositions(state.trained_below, state.trained_above,
                                             state.groups_trained)
        self._redo.extend(state.redo())
        self._data_pos = state.admitted_to

    # ---- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Controller:
        try:
            await self.start()
        except BaseException:
            await self.aclose()  # a half-started controller leaves no process or socket behind
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        from flowrl.monitor import LoopLag, MonitorServer  # aiohttp loads only when running

        self._lag = LoopLag()
        if self.monitor_config is not None:
            # First, so a refused bind fails before any process starts.
            self._monitor = MonitorServer(self, self.monitor_config)
            url = await self._monitor.start()
            self._log().info("monitor listening", url=url)
        # Marked with this process, so that if it is killed the next start sweeps the directory.
        claim_run_dir(self.run_id)
        self._server = RpcServer(ipc_endpoint(self.run_id, "ctl"), self._handlers())
        endpoint = self._endpoint = await self._server.start()
        hub = self._hub
        self._pub = (Publisher(ipc_endpoint(self.run_id, "pub")) if hub is None
                     else hub.publisher(ipc_endpoint(self.run_id, "pub")))
        self._broadcast = await self._pub.start()
        loop = asyncio.get_running_loop()
        self._owned = [loop.create_task(self._free_loop(), name="flowrl-free"),
                       loop.create_task(self._watchdog(), name="flowrl-watchdog"),
                       loop.create_task(self._publish_loop(), name="flowrl-publish"),
                       loop.create_task(self._restart_loop(), name="flowrl-restart"),
                       loop.create_task(self._lag.run(), name="flowrl-loop-lag")]
        peer_store: list[str] = []
        if hub is not None:
            # Other nodes' agents and workers reach this controller over tcp+curve.
            await hub.start(self._handlers())
            self._owned.append(loop.create_task(hub.run(), name="flowrl-nodes"))
            peer_store = hub.store_args()
            self._log().info("listening for node agents", endpoint=hub.endpoint,
                             nodes=hub.nodes)
        if self._rendezvous is not None:
            self._log().warning(
                "trainer ranks meet across nodes in an unauthenticated store; their "
                "collectives are unencrypted", store=self._rendezvous.start())
        store = ipc_endpoint(self.run_id, f"store-{self.node}")
        await self._supervisor.spawn(
            f"node:{self.node}",
            [sys.executable, "-m", "flowrl.node", "--run-id", self.run_id, "--node", self.node,
             "--controller", endpoint, "--store", store,
             "--capacity", str(self.spec.store_capacity_bytes), *peer_store],
            env=None if hub is None else hub.keys.to_env(),
        )
        async with asyncio.timeout(self.start_timeout_s):
            await self._node_up.wait()
        if hub is None:
            self._store = RpcClient(self._store_endpoint)
        else:
            try:
                await hub.wait_ready()
            except RuntimeError as exc:
                raise RunError(str(exc)) from None
            self._store = StoreRouter(self._store_endpoint, self.node, hub.peers, hub.keys)
        for pool in self.spec.pools:
            procs = math.ceil(pool.count / pool.per_process)
            for p in range(procs):
                count = min(pool.per_process, pool.count - p * pool.per_process)
                await self._spawn_workers(pool.role, p, count, pool.capacity, pool.threads)
        expected = sum(p.count for p in self.spec.pools)
        try:
            async with asyncio.timeout(self.start_timeout_s):
                while len(self.registry) < expected:
                    self._registered.clear()
                    await self._registered.wait()
                    if self._fatal is not None:
                        raise self._fatal
        except TimeoutError:
            have = collections.Counter(w.role for w in self.registry.all())
            missing = {p.role: p.count - have[p.role] for p in self.spec.pools
                       if have[p.role] < p.count}
            raise RunError(f"workers did not register within {self.start_timeout_s}s: "
                           f"missing {missing}") from None
        self._log().info("controller ready", workers=len(self.registry))

    async def _spawn_workers(
        self, role: str, proc_no: int, count: int, capacity: int, threads: int
    ) -> Child | None:
        """Start worker process ``proc_no`` of `role` on its node: here as a child, on another
        node through that node's agent (None is returned then)."""
        self._worker_procs[f"{role}.{proc_no}"] = (role, proc_no, count, capacity, threads)
        node = self._node_of(role, proc_no)
        if node != self.node:
            assert self._hub is not None  # made whenever a pool names another node
            self._hub.spawn(node, {
                "name": f"{role}.{proc_no}", "role": role, "count": count,
                "capacity": capacity, "threads": threads, "engine": self.spec.engine,
                "engine_config": self._engine_config(),
                "seed": self.spec.seed * 1000 + proc_no, "heartbeat": self.spec.heartbeat_s})
            return None
        argv = [
            sys.executable, "-m", "workers.main", "--run-id", self.run_id, "--node", self.node,
            "--controller", self._endpoint, "--broadcast", self._broadcast,
            "--store", self._store_endpoint, "--role", role, "--count", str(count),
            "--capacity", str(capacity), "--threads", str(threads),
            "--engine", self.spec.engine,
            "--engine-config", json.dumps(self._engine_config()),
            "--seed", str(self.spec.seed * 1000 + proc_no),
            "--heartbeat", str(self.spec.heartbeat_s), "--name", f"{role}.{proc_no}",
            "--weight-sync-timeout", str(self.spec.weight_sync_timeout_s),
        ]
        if self._hub is None:
            return await self._supervisor.spawn(f"{role}.{proc_no}", argv)
        argv += ["--peers", json.dumps(self._hub.peers_for(self.node))]
        return await self._supervisor.spawn(f"{role}.{proc_no}", argv,
                                            env=self._hub.keys.to_env())

    def _node_of(self, role: str, proc_no: int) -> str:
        """The node worker process ``proc_no`` of `role` runs on (its pool's nodes in turn)."""
        pool = self.spec.pool(role)
        return pool.nodes[proc_no % len(pool.nodes)] if pool and pool.nodes else self.node

    def _engine_config(self) -> dict[str, Any]:
        """What worker processes are configured with: the spec's, plus, for data-parallel
        trainer ranks, the generation of a restarted group (its ranks meet in a fresh
        rendezvous) and the store that ranks on several nodes meet in."""
        config = self.spec.engine_config
        section = config.get("data_parallel")
        extra: dict[str, Any] = {}
        if self._dp_generation:
            extra["generation"] = self._dp_generation
        if self._rendezvous is not None:
            extra["store"] = self._rendezvous.address
        if not extra or not section:
            return config
        return {**config, "data_parallel": {**section, **extra}}

    async def aclose(self) -> None:
        """Stop workers, the node agent and the sockets; leaves no process or file behind."""
        self._stop.set()
        if self._monitor is not None:
            await self._monitor.aclose()
        if self._pub is not None:
            await self._pub.publish(m.TOPIC_STOP, {"reason": "controller closing"})
        # Workers leave on the stop broadcast; the node agent (which owns shared memory that
        # workers may still be reading) is asked to go only once they are gone.
        await self._supervisor.stop_all(grace_s=5.0, only=lambda c: not c.name.startswith("node:"))
        await self._supervisor.stop_all(grace_s=0.0)
        if self._rendezvous is not None:
            self._rendezvous.close()
        for t in self._owned:
            t.cancel()
        await asyncio.gather(*self._owned, return_exceptions=True)
        if self._store is not None:
            await self._store.aclose()
        if self._pub is not None:
            await self._pub.aclose()
        if self._server is not None:
            await self._server.aclose()
        remove_run_dir(self.run_id)

    # ---- running ---------------------------------------------------------------------------

    async def run(self, steps: int, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Run ``steps`` optimizer steps; returns a summary of the run."""
        self._steps_target = self.version + steps
        self._steps_done_evt.clear()
        self._t0 = self._last_step_at = time.perf_counter()
        samples0 = self._samples_trained
        self._running = True
        self._wake()
        try:
            async with asyncio.timeout(timeout_s):
                await self._steps_done_evt.wait()
        finally:
            self._running = False
        if self._fatal is not None:
            raise self._fatal
        wall = time.perf_counter() - self._t0
        samples = self._samples_trained - samples0
        return {"steps": steps, "wall_s": wall, "samples": samples,
                "samples_per_s": samples / wall if wall > 0 else 0.0,
                "version": self.version, "stale_dropped": self.stale_dropped,
                "rows_trained_twice": self.rows_trained_twice,
                "staleness": self.gate.histogram()}

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every step and worker event."""
        while not predicate():
            if self._fatal is not None:
                raise self._fatal
            await self._changed.wait()

    # ---- control (also the monitor's POST endpoints) -----------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Admit no new group and dispatch no new task; tasks already assigned still finish.

        A ``paused`` event is emitted now and a ``drained`` event once nothing is in flight.
        """
        if self._paused:
            return
        self._paused = True
        self._drained_sent = False
        self.events.emit("paused", version=self.version, in_flight=len(self._assigned))
        if not self._assigned:
            self._drained_sent = True
            self.events.emit("drained", version=self.version)
        self._notify()

    def resume(self) -> None:
        """Undo `pause`: the scheduler dispatches whatever became possible meanwhile."""
        if not self._paused:
            return
        self._paused = False
        self.events.emit("resumed", version=self.version)
        self._notify()
        self._wake()

    def set_max_staleness(self, n: int) -> None:
        """Change the staleness budget; applies to the next admission and train decisions."""
        old = self.gate.max_staleness
        self.gate.set_max_staleness(n)
        if n != old:
            self.events.emit("staleness", max_staleness=n, previous=old, version=self.version)
            self._log().info("max_staleness changed", max_staleness=n, previous=old)
            self._notify()
            self._wake()

    def stop(self) -> None:
        """End the current `run` at the last completed step, as if it were its target.

        Nothing new is dispatched; tasks already handed out still report, and a step they
        complete still commits (its rows are trained, not lost), so `version` may move past
        the version in the summary `run` returned."""
        self._steps_target = self.version
        self.events.emit("stopping", version=self.version)
        self._steps_done_evt.set()
        self._notify()

    @property
    def monitor(self) -> MonitorServer | None:
        """The HTTP monitor, once the controller started with one."""
        return self._monitor

    @property
    def monitor_url(self) -> str | None:
        """The dashboard's URL, once the controller started with a monitor."""
        return None if self._monitor is None else self._monitor.url

    @property
    def monitor_token(self) -> SecretStr | None:
        """The bearer token the monitor's control endpoints require (kept secret in reprs)."""
        return None if self._monitor is None else self._monitor.token

    # ---- the monitor's view of the run (flowrl.monitor.view.RunView) ----------------------

    @property
    def max_staleness(self) -> int:
        return self.gate.max_staleness

    def roles(self) -> list[str]:
        return [p.role for p in self.spec.pools]

    def worker_roles(self) -> list[tuple[str, str]]:
        return [(w.worker_id, w.role) for w in self.registry.all()]

    def _log(self) -> Any:
        """The controller's logger with the context every line carries."""
        return log.bind(run_id=self.run_id, role="controller", version=self.version)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        """Something changed: dispatch whatever became possible, at once and inline.

        Every caller is an event (a report, a death, a new version), so the scheduler never
        polls; a pass costs O(stages + tasks dispatched + open workers), cheap enough to run in
        the handler itself, which keeps dispatch latency free of event-loop queueing.
        """
        if (not self._running or self._dispatching or self._stop.is_set()
                or self._fatal is not None):
            return
        self._dispatching = True
        self._kick_at = time.perf_counter()
        try:
            self._dispatch_pass()
        except Exception as exc:  # a scheduler bug must stop the run loudly, not a worker's call
            self._log().exception("dispatch failed")
            self._fail_run(RunError(f"dispatch failed: {exc!r}"))
        finally:
            self._dispatching = False

    def _dispatch_pass(self) -> None:
        if self._paused:
            if not self._assigned and not self._drained_sent:
                self._drained_sent = True
                self.events.emit("drained", version=self.version)
            return
        for stage in self.graph.order:
            if stage is self._source_stage:
                self._dispatch_source(stage)
            elif stage is self._train_stage:
                self._dispatch_train(stage)
            else:
                self._dispatch_rows(stage)

    def _dispatch_rows(self, stage: StageSpec) -> None:
        while True:
            w = self.registry.least_loaded(stage.role)
            if w is None:
                return
            task = self.index.request(stage.name, stage.micro_batch, worker=w.worker_id)
            if task is None:
                return
            self._assign(w, task, {})

    def _dispatch_source(self, stage: StageSpec) -> None:
        """Admit prompt groups and hand them to rollout, ``stage.micro_batch`` groups a task.

        Several groups per task let an engine sample them in one batched call; a task's groups
        are admitted together, so each must be one the chosen worker's version may generate.
        """
        s = self.gate.max_staleness
        k = stage.micro_batch
        # Groups given back by failed tasks go first; they were admitted for earlier steps.
        while True:
            w = self.registry.least_loaded(stage.role)
            if w is None:
                return
            task = self.index.request(stage.name, k, worker=w.worker_id)
            if task is None:
                break
            need = max(self._group_step[g] for g in task.groups) - s
            if w.version < need:
                other = self.registry.least_loaded(stage.role, need)
                if other is None:
                    self._fail_task(task.id)
                    return
                w = other
            self._assign(w, task, {})
        if self._steps_target and self.version >= self._steps_target:
            return
        n = self.spec.group_size
        while self.gate.can_admit(self._admitted, self.version) and self._store_admits():
            step = self._admitted // self.spec.groups_per_step
            w = self.registry.least_loaded(stage.role, step - s)
            if w is None:
                return
            positions: list[int] = []
            for _ in range(k):
                step = self._admitted // self.spec.groups_per_step
                if (not self.gate.can_admit(self._admitted, self.version)
                        or w.version < step - s or not self._store_admits()):
                    break
                if self._redo:
                    pos = self._redo.popleft()
                else:
                    pos, self._data_pos = self._data_pos, self._data_pos + 1
                gid = self.index.add_group(n, fields={"prompt": [pos] * n})
                self._group_step[gid] = step
                self._group_pos[gid] = pos
                self._admitted += 1
                positions.append(pos)
            task = self.index.request(stage.name, len(positions), worker=w.worker_id)
            assert task is not None
            self._assign(w, task, {"data_pos": positions})

    def _dispatch_train(self, stage: StageSpec) -> None:
        if self._dp is not None:
            self._dispatch_train_ranks(stage, self._dp)
            return
        g = self.spec.groups_per_step
        while self._train_step < self._steps_target:
            w = self.registry.least_loaded(stage.role)
            if w is None:
                return
            want = min(stage.micro_batch, g - self._train_groups_in_step)
            min_version = self.gate.min_train_version(self._train_step)
            task = self.index.request(stage.name, want, min_version=min_version,
                                      worker=w.worker_id)
            self._drop_stale()
            if task is None:
                return
            self._train_groups_in_step += len(task.groups)
            end = self._train_groups_in_step >= g
            self._assign(w, task, self._train_params(end))
            if end:
                self._train_step += 1
                self._train_groups_in_step = 0

    def _dispatch_train_ranks(self, stage: StageSpec, dp: RankShares[Task]) -> None:
        """`_dispatch_train` for data-parallel ranks (`flowrl.dp`): streamed micro-batches go
        to the rank given the fewest tokens this step; the step's last groups go one to every
        rank, each ending that rank's step."""
        slots = self.registry.tasks_per_slot
        while self._train_step < self._steps_target:
            ranks = self.registry.of_role(stage.role)
            if len(ranks) < dp.ranks:
                return  # every rank takes part in every step
            w: WorkerInfo | None = None
            if not dp.closing(self._train_groups_in_step):
                room = {r.worker_id: r for r in ranks if len(r.tasks) < r.capacity * slots}
                chosen = dp.choose(list(room))
                if chosen is None:
                    return
                w = room[chosen]
            min_version = self.gate.min_train_version(self._train_step)
            task = self.index.request(stage.name, dp.want(self._train_groups_in_step),
                                      min_version=min_version,
                                      worker=None if w is None else w.worker_id)
            self._drop_stale()
            if task is None:
                return
            self._train_groups_in_step += len(task.groups)
            if w is not None:
                dp.add(w.worker_id, task.tokens)
                self._assign(w, task, self._train_params(False))
                continue
            passes = dp.passes()
            placed = dp.hold(task, task.tokens, [r.worker_id for r in ranks])
            if placed is None:
                continue
            for worker_id, held in placed:
                info = self.registry.get(worker_id)
                assert info is not None  # listed above, in this same pass
                self._assign(info, held, {**self._train_params(True), "passes": passes})
            self._train_step += 1
            self._train_groups_in_step = 0

    def _train_params(self, step_end: bool) -> dict[str, Any]:
        """What a train task tells its trainer: the step, whether it ends it, which attempt."""
        return {"step": self._train_step, "step_end": step_end, "attempt": self._step_attempt}

    def _drop_stale(self) -> None:
        for gid in self.index.take_stale():
            handles = self.index.drop_group(gid)
            self._group_step.pop(gid, None)
            self._redo.appendleft(self._group_pos.pop(gid))  # its prompt is sampled again
            self.stale_dropped += 1
            self._admitted -= 1  # its slot is admitted again
            if handles:
                self._free_q.put_nowait(handles)

    def _assign(self, w: WorkerInfo, task: Task, params: dict[str, Any]) -> None:
        self.registry.assign(w, task.id, max(1, task.tokens))
        now = time.perf_counter()
        self._assigned[task.id] = _Assigned(task, w.worker_id, params, now)
        if self._kick_at:
            self.dispatch_us.append((now - self._kick_at) * 1e6)
        msg: m.TaskMsg = {
            "task_id": task.id, "stage": task.stage, "rows": list(task.rows),
            "groups": list(task.groups),
            "row_groups": [self.index.row_group(r) for r in task.rows],
            "inputs": {k: list(v) for k, v in task.handles.items()}, "params": params,
        }
        self._queues[w.worker_id].put_nowait(msg)

    # ---- request handlers ------------------------------------------------------------------

    def _handlers(self) -> dict[str, Any]:
        as_worker = self._as_worker
        return {
            m.OP_REGISTER: self._on_register,
            m.OP_HEARTBEAT: as_worker(self._on_heartbeat),
            m.OP_GET_TASK: as_worker(self._on_get_task),
            m.OP_TASK_DONE: as_worker(self._on_task_done),
            m.OP_TASK_FAILED: as_worker(self._on_task_failed),
            m.OP_SERVED: as_worker(self._on_served),
            m.OP_BYE: as_worker(self._on_bye),
            m.OP_SYNC_FAILED: as_worker(self._on_sync_failed),
            "node_up": self._on_node_up,
        }

    def _as_worker(self, handler: Handler) -> Handler:
        """``handler`` for calls in a worker's name: a call naming a registered worker must
        carry the token of that worker's register reply, so another process that learnt (or
        guessed) a worker id cannot act as that worker. Unknown ids reach the handler, which
        answers them as it always has."""
        async def checked(p: Any, peer: bytes) -> Any:
            wid = p.get("worker_id") if isinstance(p, dict) else None
            info = self.registry.get(wid) if type(wid) is str else None
            if info is not None:
                token = p.get("token")
                if type(token) is not bytes or not hmac.compare_digest(token, info.token):
                    raise PermissionError(f"a call for worker {wid} without its token")
            return await handler(p, peer)
        return checked

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    async def _on_node_up(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        if self._node_up.is_set():  # the agent reports once: a replay must not move the store
            return {"ok": False}
        self._store_endpoint = _str(p, "store")
        if self._hub is not None and p.get("peer_store"):
            self._hub.add_peer(self.node, _str(p, "peer_store"))
        self._node_up.set()
        return {"ok": True}

    # ---- other nodes ----------------------------------------------------------------------

    @property
    def nodes(self) -> NodeHub | None:
        """Where agents of the other nodes meet this controller (None on one node)."""
        return self._hub

    def _on_node_lost(self, node: str) -> None:
        if not self._stop.is_set():
            self._fail_run(RunError(f"node agent {node!r} stopped answering"))

    def _on_remote_exit(self, node: str, name: str, pid: int, code: int,
                        expected: bool) -> None:
        """A worker process on another node exited: as `_on_child_exit` for a child here."""
        for info in self.registry.all():
            if info.node == node and info.pid == pid:
                self._worker_gone(info.worker_id, f"process {pid} on {node} exited with {code}")
        # pid -1 matches no worker here (pids of different nodes may coincide).
        self._on_child_exit(cast(Child, _RemoteExit(name, expected_exit=expected)), code)

    async def _on_register(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        role = _str(p, "role")
        if self.spec.pool(role) is None:
            raise ValueError(f"no pool for role {role!r} in this pipeline")
        latest = self._weights.get(self.version)
        info = self.registry.register(
            name=_str(p, "name"), role=role, node=_str(p, "node"),
            pid=_int(p, "pid", 1, 2**31), capacity=_int(p, "capacity", 1, _MAX_CAPACITY),
            # Without published weights of the current version (the run's start, or a resume
            # before its first step) the model every worker loads *is* that version; otherwise
            # the worker serves it once it has loaded the weights and said so (`served`).
            version=self.version if latest is None else 0, now=self._now())
        self._queues[info.worker_id] = asyncio.Queue()
        self._registered.set()
        self._wake()
        self._log().info("worker up", worker=info.worker_id, name=info.name, node=info.node)
        self.events.emit("worker_up", worker=info.worker_id, role=role, node=info.node,
                         name=info.name)
        self._notify()  # `wait_for` predicates may ask for a worker (a restarted one)
        return {"worker_id": info.worker_id, "token": info.token, "version": self.version,
                "weights": latest}

    async def _on_heartbeat(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        info = self.registry.heartbeat(str(p["worker_id"]), self._now())
        return {"ok": info is not None}

    async def _on_get_task(self, p: dict[str, Any], peer: bytes) -> m.TaskMsg | None:
        done = p.get("done")
        if done is not None:
            await self._on_reported(done, p.get("worker_id"), peer)
        q = self._queues.get(str(p["worker_id"]))
        if q is None:
            return None
        try:
            async with asyncio.timeout(_seconds(p, "wait_s")):
                msg = await q.get()
        except TimeoutError:
            return None
        a = self._assigned.get(msg["task_id"])
        if a is not None:
            a.started_at = time.time()
        return msg

    async def _on_reported(self, done: Any, poller: Any, peer: bytes) -> None:
        """A task's report that came with the worker's next poll: taken as ``task_done``; one
        that cannot be taken fails its task (its rows go to another worker), not the poll. A
        worker reports only its own tasks (its poll carried its token, not the report)."""
        if not isinstance(done, dict) or done.get("worker_id") != poller:
            self._log().warning("ignored a malformed task report", report=repr(done)[:200])
            return
        try:
            await self._on_task_done(done, peer)
        except (KeyError, TypeError, ValueError) as exc:
            task_id = done.get("task_id")
            if type(task_id) is int:
                await self._on_task_failed({"worker_id": done.get("worker_id"),
                                            "task_id": task_id,
                                            "error": f"malformed task report: {exc!r}"}, peer)

    async def _on_task_done(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        # Checked before the task is finished: a report refused later would lose its rows.
        given = p.get("fields") if isinstance(p, dict) else None
        if not (isinstance(given, dict)
                and all(type(k) is str and type(v) is list for k, v in given.items())):
            raise ValueError("'fields' must map field names to lists")
        lengths_in = p.get("lengths") or []
        if not (type(lengths_in) is list and all(type(n) is int for n in lengths_in)):
            raise ValueError("'lengths' must be a list of ints")
        a = self._finish(p, ok=True)
        if a is None:
            return {"ok": False}
        task = a.task
        fields: dict[str, list[Any]] = p["fields"]
        lengths: list[int] = list(p.get("lengths") or [])
        if task.stage == (self._train_stage.name if self._train_stage else None):
            if self._dp is not None:
                self._rank_done(a, p)
            else:
                self._step_tasks.append(task.id)
                if a.params.get("step_end"):
                    self._commit_step(p)
        else:
            produced = {k: v for k, v in fields.items()}
            retired = self.index.complete(task.id, produced, version=p.get("version"),
                                          lengths=lengths or None)
            if retired:
                self._free_q.put_nowait(retired)
            self._fold_metrics(p.get("metrics"))
        self._wake()
        return {"ok": True}

    def _fold_metrics(self, metrics: Any) -> None:
        """What the step log shows of other stages' task metrics: reward failures
        (``reward_failed``, ``reward_failed_<kind>``) summed over the step, and the critic's
        step figures (``critic_*``, reported by the task whose rows completed a critic step)
        as last reported. Values that are not finite numbers are ignored."""
        if not isinstance(metrics, dict):
            return
        acc = self._stage_metrics
        for key, value in metrics.items():
            if type(key) is not str or type(value) not in (int, float) or not math.isfinite(value):
                continue
            if key.startswith("reward_failed"):
                acc[key] = acc.get(key, 0.0) + value
            elif key.startswith("critic_"):
                acc[key] = float(value)

    def _rank_done(self, a: _Assigned, p: dict[str, Any]) -> None:
        """A data-parallel rank trained a micro-batch. A step commits once every rank reported
        its end (`flowrl.dp.merge_step_ends`); ranks may train the next step meanwhile."""
        assert self._dp is not None
        tasks, ends = self._dp_done.setdefault(int(a.params["step"]), ([], []))
        tasks.append(a.task.id)
        if a.params.get("step_end"):
            ends.append(p)
        while (done := self._dp_done.get(self.version)) and len(done[1]) == self._dp.ranks:
            del self._dp_done[self.version]
            try:
                merged = merge_step_ends(done[1])
            except StepDivergence as exc:
                self._fail_run(RunError(str(exc)))
                return
            self._step_tasks = done[0]
            self._commit_step(merged)

    def _commit_step(self, p: dict[str, Any]) -> None:
        """All micro-batches of a step are trained: commit them and publish the new version."""
        new_version = int(p["version"])
        if new_version != self.version + 1:
            self._fail_run(RunError(
                f"trainer {p.get('worker_id')} published version {new_version} while the "
                f"controller is at version {self.version}: the trainer lost its state"))
            return
        rewards: list[float] = []
        staleness: list[int] = []
        samples = 0
        for task_id in self._step_tasks:
            task = self._assigned_done.pop(task_id)
            staleness.extend(self.version - (v or 0) for v in task.versions)
            self.gate.record_trained(task.versions, self.version)
            for gid in task.groups:
                self._group_step.pop(gid, None)
                pos = self._group_pos.pop(gid, None)
                # A group's dataset position trains once in a run (resumes included).
                if pos is None or not self._trained_pos.add(pos):
                    self.rows_trained_twice += sum(
                        1 for r in task.rows if self.index.row_group(r) == gid)
            self.rows_trained += len(task.rows)
            rewards.extend(float(r) for r in task.handles.get("reward", ()))
            samples += len(task.rows)
            retired = self.index.complete(task_id)
            if retired:
                self._free_q.put_nowait(retired)
        self._step_tasks.clear()
        self._samples_trained += samples
        self.version = new_version
        weights = p.get("weights")
        if weights:
            self._weights[new_version] = weights
            self._pub_q.put_nowait((m.TOPIC_VERSION, {"version": new_version, "weights": weights}))
        self._release_old_weights()
        now = time.perf_counter()
        wall = now - self._t0
        entry: dict[str, Any] = {
            "step": new_version,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "samples": samples,
            "samples_per_s": samples / (now - self._last_step_at) if self._last_step_at else 0.0,
            "staleness_max": max(staleness, default=0),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "served_versions": sorted(
                {w.version for w in self.registry.of_role(self._source_stage.role)}),
            "wall_s": wall,
            "reward_failed": 0.0,
            **self._stage_metrics,
            **{f"train_{k}": v for k, v in (p.get("metrics") or {}).items()},
        }
        self._stage_metrics = {}
        self._last_step_at = now
        self._save_run_state()
        self.step_log.append(entry)
        self._log().debug("step", **entry)
        self.events.emit("step", **entry)
        if weights:
            self.events.emit("version", version=new_version)
        for callback in self.on_step:
            callback(entry)
        if self.version >= self._steps_target:
            self._steps_done_evt.set()
        self._notify()

    def run_state(self) -> RunState:
        """What `--resume` needs to continue from this version (see `flowrl.resume`)."""
        t = self._trained_pos
        return RunState(version=self.version, trained_below=t.below,
                        trained_above=sorted(t.above), admitted_to=self._data_pos,
                        groups_trained=t.count)

    def _save_run_state(self) -> None:
        """Complete the trainer's checkpoint of this version, when it wrote one."""
        if self.spec.output is None:
            return
        step_dir = Path(self.spec.output) / f"step_{self.version}"
        if not step_dir.is_dir():
            return
        try:
            write_state(step_dir, self.run_state())
        except OSError as exc:  # the step is committed; only resuming from here is lost
            self._log().error("run state not saved", path=str(step_dir), error=repr(exc))

    async def _publish_loop(self) -> None:
        """Broadcasts leave in order from one owned task, never from fire-and-forget tasks."""
        assert self._pub is not None
        while True:
            topic, payload = await self._pub_q.get()
            await self._pub.publish(topic, payload)

    def _release_old_weights(self) -> None:
        rollout = self._source_stage.role
        served = [w.version for w in self.registry.of_role(rollout)]
        keep_from = min([*served, self.version])
        for v in [v for v in self._weights if v < keep_from and v != self.version]:
            handles = [h for h, _shape in self._weights.pop(v).values()]
            self._free_q.put_nowait(handles)

    async def _on_task_failed(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        a = self._finish(p, ok=False)
        if a is not None:
            error = str(p.get("error", ""))
            record = {"worker": a.worker, "stage": a.task.stage, "task": a.task.id,
                      "version": self.version, "error": error}
            self.errors.append(record)
            self.events.emit("error", **record)
            key = (a.task.stage, a.task.rows[0] if a.task.rows else -1)
            self._failures[key] += 1
            if self._failures[key] >= self.spec.max_task_failures:
                self._fail_run(RunError(
                    f"stage {a.task.stage!r} failed {self._failures[key]} times on rows "
                    f"starting at {key[1]} (last on worker {a.worker}, policy version "
                    f"{self.version}): {error}"))
            self._give_back(a)
            rank = self.registry.get(a.worker)
            if self._dp is not None and self._is_train(a) and rank is not None:
                # The group's collectives may be out of step now (a pass that failed half-way,
                # a peer that died): only a fresh group is sure to pair them up again.
                self._train_group_down(rank, f"failed a micro-batch of step "
                                             f"{a.params.get('step')}: {error}")
        self._wake()
        return {"ok": True}

    def _finish(self, p: dict[str, Any], *, ok: bool) -> _Assigned | None:
        task_id = int(p["task_id"])
        a = self._assigned.get(task_id)
        if a is None or a.worker != str(p["worker_id"]):
            return None  # a late report from a worker already declared dead
        info = self.registry.get(a.worker)
        if info is not None:
            self.registry.finish(info, task_id, ok=ok)
        del self._assigned[task_id]
        if a.started_at:
            self.events.span(Span(a.worker, info.role if info else "", a.task.stage, task_id,
                                  len(a.task.rows), a.started_at, time.time()))
        if ok and self._train_stage is not None and a.task.stage == self._train_stage.name:
            self._assigned_done[task_id] = a.task
        return a

    def _is_train(self, a: _Assigned) -> bool:
        return self._train_stage is not None and a.task.stage == self._train_stage.name

    def _give_back(self, a: _Assigned) -> None:
        """A task failed: its rows return to the stage's queue (a train task undoes its step)."""
        if self._is_train(a):
            self._abort_step([a.task.id])
        else:
            self._fail_task(a.task.id)

    def _abort_step(self, extra: list[int]) -> None:
        """The trainer lost its accumulated gradients: redo every micro-batch of the step."""
        step_tasks = [t for t, a in self._assigned.items() if self._is_train(a)]
        if self._dp is not None:  # held for the closing round, or done on some ranks
            step_tasks += [t.id for t in self._dp.new_step()]
            step_tasks += [t for tasks, _ in self._dp_done.values() for t in tasks]
            self._dp_done.clear()
        for task_id in [*extra, *self._step_tasks, *step_tasks]:
            self._assigned.pop(task_id, None)
            self._assigned_done.pop(task_id, None)
            self._fail_task(task_id)
        for w in self.registry.of_role(self._train_stage.role if self._train_stage else ""):
            for task_id in list(w.tasks):
                self.registry.finish(w, task_id, ok=False)
            self._drain_queue(w.worker_id)
        self._step_tasks.clear()
        self._train_step = self.version
        self._train_groups_in_step = 0
        # The redo is a new attempt: a trainer that kept gradients of the failed one drops them.
        self._step_attempt += 1

    def _fail_task(self, task_id: int) -> None:
        freed = self.index.fail(task_id)
        if freed:
            self._free_q.put_nowait(freed)

    def _drain_queue(self, worker_id: str) -> None:
        q = self._queues.get(worker_id)
        while q is not None and not q.empty():
            q.get_nowait()

    async def _on_served(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        info = self.registry.get(str(p["worker_id"]))
        if info is not None:
            info.version = int(p["version"])
            self._release_old_weights()
            self._wake()
        return {"ok": True}

    async def _on_sync_failed(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        """A worker missed its weight-sync deadline: say who and which version; it exits next,
        and its process is restarted like any dead worker (bounded by ``max_restarts``)."""
        info = self.registry.get(_str(p, "worker_id"))
        if info is None:
            return {"ok": False}
        error = _str(p, "error")[:500]
        record: dict[str, Any] = {
                  "worker": info.worker_id, "name": info.name, "node": info.node,
                  "stage": "weight_sync", "version": _int(p, "version", 0, 2**62),
                  "served": info.version, "error": error}
        self.errors.append(record)
        self.events.emit("error", **record)
        self._log().error("weight sync failed", **record)
        self._last_error[info.name.rsplit(".", 1)[0]] = error
        return {"ok": True}

    async def _on_bye(self, p: dict[str, Any], peer: bytes) -> dict[str, Any]:
        self._worker_gone(str(p["worker_id"]), "said bye")
        return {"ok": True}

    # ---- liveness --------------------------------------------------------------------------

    def _worker_gone(self, worker_id: str, why: str) -> None:
        info = self.registry.remove(worker_id)
        if info is None:
            return
        if not self._stop.is_set():
            self.worker_deaths += 1
            self._log().warning("worker down", worker=worker_id, name=info.name, why=why,
                        tasks=len(info.tasks))
            self.errors.append({"worker": worker_id, "error": f"worker down: {why}"})
            self.events.emit("worker_down", worker=worker_id, role=info.role, why=why)
            self._notify()
        self._queues.pop(worker_id, None)
        lost_train: list[int] = []
        for task_id in list(info.tasks):
            a = self._assigned.pop(task_id, None)
            if a is None:
                continue
            if self._is_train(a):
                lost_train.append(task_id)
            else:
                self._fail_task(task_id)
        if self._train_stage is not None and info.role == self._train_stage.role:
            self._abort_step(lost_train)
            if self._dp is not None and not self._stop.is_set():
                self._train_group_down(info, why)
        self._wake()

    def _train_group_down(self, info: WorkerInfo, why: str) -> None:
        """A data-parallel trainer rank went down or failed a micro-batch. The others cannot
        step without it and a rank cannot rejoin a running group, so the whole group is
        restarted (its step redone, every rank loading the current version), counted against
        ``max_restarts``."""
        if self._dp_restarting or self._fatal is not None:
            return  # another rank of a group already being restarted
        n = self._restarts[_TRAIN_GROUP] = self._restarts[_TRAIN_GROUP] + 1
        if n > self.spec.max_restarts:
            self._fail_run(RunError(
                f"data-parallel trainer rank {info.name} went down ({why}) and the group is not "
                f"restarted: the group was restarted {n - 1} times; max_restarts is "
                f"{self.spec.max_restarts}. Resume the run from its last checkpoint"))
            return
        self._dp_restarting = True
        self._dp_generation += 1
        delay = self._restart_delay(n)
        self._log().warning("restarting the data-parallel trainer group", rank=info.name,
                            why=why, attempt=n, delay_s=delay)
        self._restart_q.put_nowait((_TRAIN_GROUP, delay))

    def _fail_run(self, error: RunError) -> None:
        """Stop the run with ``error``: every waiter wakes up and raises it."""
        if self._fatal is None:
            self._log().error("run failed", error=str(error))
            self.events.emit("run_failed", error=str(error))
            self._fatal = error
        self._registered.set()
        self._steps_done_evt.set()
        self._node_up.set()
        self._notify()

    def _on_child_exit(self, child: Child, code: int) -> None:
        if child.name.startswith("node:") and not self._stop.is_set():
            self._fail_run(RunError(f"node agent {child.name} exited with code {code}"))
            return
        for info in self.registry.by_pid(child.pid):
            self._worker_gone(info.worker_id, f"process {child.pid} exited with code {code}")
        if (self._stop.is_set() or child.expected_exit or child.name not in self._worker_procs
                or self._fatal is not None or self._is_rank_process(child.name)):
            return  # (a data-parallel rank's group is restarted as a whole: _train_group_down)
        n = self._restarts[child.name] = self._restarts[child.name] + 1
        if n > self.spec.max_restarts:
            last = self._last_error.get(child.name)
            self._fail_run(RunError(
                f"worker process {child.name} died {n} times (last exit code {code}"
                f"{': ' + last if last else ''}); max_restarts is {self.spec.max_restarts}"))
            return
        delay = self._restart_delay(n)
        self._log().warning("restarting worker process", process=child.name, attempt=n,
                            delay_s=delay)
        self._restart_q.put_nowait((child.name, delay))

    async def _restart_loop(self) -> None:
        """Restarts dead worker processes, each after its own backoff (processes killed
        together come back together; bounded by ``max_restarts``)."""
        async with asyncio.TaskGroup() as tg:  # cancelled with the controller: so are these
            while True:
                name, delay = await self._restart_q.get()
                tg.create_task(self._restart(name, delay), name=f"flowrl-restart-{name}")

    def _restart_delay(self, n: int) -> float:
        """The wait before restart ``n`` (1-based): doubling from ``restart_backoff_s``, capped
        (with a high max_restarts, doubling alone would reach hours)."""
        return min(self.spec.restart_backoff_s * 2.0 ** (n - 1), _MAX_RESTART_BACKOFF_S)

    def _is_rank_process(self, name: str) -> bool:
        return (self._dp is not None and self._train_stage is not None
                and name.rpartition(".")[0] == self._train_stage.role)

    async def _restart(self, name: str, delay: float) -> None:
        if name == _TRAIN_GROUP:
            await self._restart_train_group(delay)
            return
        await asyncio.sleep(delay)  # backoff timer, not a poll
        if self._stop.is_set():
            return
        role, proc_no, count, capacity, threads = self._worker_procs[name]
        try:
            await self._spawn_workers(role, proc_no, count, capacity, threads)
        except Exception as exc:  # a process that cannot start again ends the run, loudly
            self._fail_run(RunError(f"could not restart worker process {name}: {exc!r}"))
            return
        self.restarts += 1
        self.events.emit("worker_restart", process=name)

    async def _restart_train_group(self, delay: float) -> None:
        """Stop every rank process still running (a broken group cannot recover), here and,
        through their agents, on other nodes; wait out the backoff, start all ranks again."""
        ranks = sorted((p for name, p in self._worker_procs.items()
                        if self._is_rank_process(name)), key=lambda p: p[1])
        elsewhere: dict[str, list[str]] = {}
        for role, proc_no, *_ in ranks:
            node = self._node_of(role, proc_no)
            if node != self.node:
                elsewhere.setdefault(node, []).append(f"{role}.{proc_no}")
        await self._supervisor.stop_all(0.0, only=lambda c: self._is_rank_process(c.name),
                                        signals=(signal.SIGKILL,))
        if elsewhere:
            hub = self._hub
            assert hub is not None  # made whenever a pool names another node
            try:
                await asyncio.gather(*(hub.stop_workers(node, names)
                                       for node, names in elsewhere.items()))
            except TimeoutError:
                self._fail_run(RunError(
                    f"could not restart the data-parallel trainer group: the agents of "
                    f"{sorted(elsewhere)} did not confirm that its ranks there are gone"))
                return
        await asyncio.sleep(delay)  # backoff timer, not a poll
        if self._stop.is_set() or self._fatal is not None:
            return
        try:
            for role, proc_no, count, capacity, threads in ranks:
                await self._spawn_workers(role, proc_no, count, capacity, threads)
        except Exception as exc:  # a group that cannot start again ends the run, loudly
            self._fail_run(RunError(f"could not restart the data-parallel trainer group: "
                                    f"{exc!r}"))
            return
        self._dp_restarting = False
        self.restarts += 1
        self.events.emit("worker_restart", process=_TRAIN_GROUP)

    async def _watchdog(self) -> None:
        while True:
            deadline = self.registry.next_deadline()
            now = self._now()
            delay = self.spec.heartbeat_timeout_s if deadline is None else deadline - now
            await asyncio.sleep(max(0.0, delay) + 0.001)
            for info in self.registry.expired(self._now()):
                self._worker_gone(info.worker_id, "missed heartbeats")

    # ---- store backpressure (`flowrl.backpressure` decides; these feed it) ---------------

    def _store_admits(self) -> bool:
        """Whether the store has room for one more group (always for the next step's)."""
        was_paused = self._store_bp.paused
        if self._store_bp.admits(self._untrained_groups(), time.perf_counter()):
            if was_paused:
                self.events.emit("store_resumed", version=self.version)
            return True
        if not was_paused and self._store_bp.paused:
            self.events.emit("store_paused", version=self.version,
                             **self._store_bp.statistics(time.perf_counter()))
        self._want_store_stats()  # the refresh wakes the scheduler if there is room by then
        return False

    def _untrained_groups(self) -> int:
        """Groups admitted for steps not yet committed (their data is or will be in the store)."""
        return self._admitted - self.version * self.spec.groups_per_step

    def _want_store_stats(self) -> None:
        """Have `_free_loop` refresh `store_stats` (at most one refresh queued)."""
        if not self._store_stats_wanted:
            self._store_stats_wanted = True
            self._free_q.put_nowait([])

    def _landed_groups(self) -> int:
        """Live groups whose data the first stage has written into the store."""
        stage = self.index.statistics().stages.get(self._source_stage.name)
        return 0 if stage is None else stage.done // max(1, self.spec.group_size)

    async def _refresh_store_stats(self) -> None:
        assert self._store is not None
        landed = self._landed_groups()  # before the call: bytes per group err high
        self.store_stats = await self._store.call("stats", {}, timeout=10.0)
        self._store_bp.observe(self.store_stats, landed)
        if (self._store_bp.room(self._untrained_groups())
                and self.gate.can_admit(self._admitted, self.version)):
            self._wake()  # admission waited for this

    def _progress_mark(self) -> tuple[int, ...]:
        """Changes whenever the run moves: a task starts or ends, a step commits, a group is
        admitted, a worker comes or goes, memory is freed."""
        ended = sum(w.done + w.failed for w in self.registry.all())
        return (self.version, ended, self._started_tasks(), len(self.registry),
                len(self._assigned), self.worker_deaths, self.restarts, self._admitted,
                self._store_bp.free_batches)

    def _started_tasks(self) -> int:
        return sum(1 for a in self._assigned.values() if a.started_at)

    async def _check_store_stall(self) -> None:
        """The run has been quiet: stop it if it is stuck on a store too small for a step."""
        if (self._store is None or not self._running or self._paused or self._fatal is not None
                or self._stop.is_set()):
            return
        mark = self._progress_mark()
        await self._refresh_store_stats()
        now = time.perf_counter()
        if (self._store_bp.stalled(mark, self._started_tasks(), now)
                and mark == self._progress_mark()):
            latest = self._weights.get(self.version) or {}
            weights = sum(Handle.from_wire(h).nbytes for h, _shape in latest.values()) or None
            self._fail_run(RunError(self._store_bp.too_small(weights_bytes=weights, now=now)))

    async def _free_loop(self) -> None:
        """Frees what the index retired, refreshes `store_stats` after frees and on request,
        and looks for a stuck store when nothing arrived for `_STORE_CHECK_S` (a deadline
        that any free or refresh pushes back; a look costs one ``stats`` call)."""
        while True:
            try:
                async with asyncio.timeout(_STORE_CHECK_S):
                    handles = await self._free_q.get()
            except TimeoutError:
                try:
                    await self._check_store_stall()
                except Exception as exc:
                    self._log().warning("store check failed", error=repr(exc))
                continue
            while not self._free_q.empty():  # batch what piled up
                handles.extend(self._free_q.get_nowait())
            wanted, self._store_stats_wanted = self._store_stats_wanted, False
            # Inline field values (prompt positions, rewards) hold no memory.
            handles = [h for h in handles if is_handle(h)]
            if self._store is not None and (handles or wanted):
                try:
                    if handles:
                        await self._store.call("free", {"handles": handles}, timeout=10.0)
                        self._store_bp.free_batches += 1
                    await self._refresh_store_stats()
                except Exception as exc:
                    self._log().warning("store free failed", error=repr(exc),
                                        handles=len(handles))

    # ---- introspection ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot of the run: exactly what the monitor's ``GET /status`` serves.

        O(stages + workers + tasks in flight); holds no secret (the monitor token is not in it).
        """
        stats = self.index.statistics()
        wall = (time.perf_counter() - self._t0) if self._t0 else 0.0
        now = time.time()
        running: dict[str, list[dict[str, Any]]] = {}
        for task_id, a in self._assigned.items():
            running.setdefault(a.worker, []).append({
                "task": task_id, "stage": a.task.stage, "rows": len(a.task.rows),
                "running_s": round(now - a.started_at, 4) if a.started_at else None})
        workers = []
        for w in self.registry.all():
            tasks = running.get(w.worker_id, [])
            started = any(t["running_s"] is not None for t in tasks)
            workers.append({
                "id": w.worker_id, "name": w.name, "role": w.role, "node": w.node, "pid": w.pid,
                "state": "busy" if started else "queued" if tasks else "idle",
                "version": w.version, "in_flight": w.in_flight, "tasks": tasks, "load": w.load,
                "done": w.done, "failed": w.failed})
        stages = {
            st.name: {"role": self.graph.stage(st.name).role,
                      "queue_depth": st.queue_depth, "in_flight": st.tasks_in_flight,
                      "in_flight_rows": st.in_flight, "waiting": st.waiting, "ready": st.ready,
                      "done": st.done, "stale": st.stale}
            for st in stats.stages.values()}
        last = self.step_log[-1] if self.step_log else {}
        return {
            "run_id": self.run_id,
            "time": now,
            "version": self.version,
            "trainer": {"version": self.version, "next_step": self._train_step,
                        "steps_target": self._steps_target,
                        "micro_batches_pending": len(self._step_tasks)},
            "paused": self._paused,
            "max_staleness": self.gate.max_staleness,
            "stages": stages,
            "index": stats.as_dict(),
            "workers": workers,
            "staleness_histogram": {str(k): v for k, v in self.gate.histogram().items()},
            "samples_trained": self._samples_trained,
            "samples_per_s": self._samples_trained / wall if wall else 0.0,
            "throughput": {"samples_per_s": self._samples_trained / wall if wall else 0.0,
                           "last_step_samples_per_s": last.get("samples_per_s", 0.0),
                           "steps": len(self.step_log)},
            "reward_mean": last.get("reward_mean"),
            "stale_dropped": self.stale_dropped,
            "store": self.store_stats,
            "admission_paused_for_store": self._store_bp.paused,
            "store_backpressure": self._store_bp.statistics(time.perf_counter()),
            "worker_deaths": self.worker_deaths,
            "restarts": self.restarts,
            "errors": list(self.errors),
            "loop_lag": self._lag.snapshot() if self._lag is not None else None,
            "events": {"last_seq": self.events.recent[-1]["seq"] if self.events.recent else 0,
                       "dropped": self.events.dropped},
            "monitor_url": self.monitor_url,
        }

    def kill_worker_process(self, pid: int) -> None:
        """SIGKILL one child (tests and chaos use this)."""
        self._supervisor.kill(pid)

    def worker_pids(self, role: str | None = None) -> list[int]:
        return sorted({w.pid for w in self.registry.all() if role in (None, w.role)})

    def _find_source_stage(self) -> StageSpec:
        src = set(self.graph.source_fields)
        firsts = [s for s in self.graph.order if set(s.needs) <= src]
        if len(firsts) != 1:
            raise ValueError(
                f"exactly one stage must read only the data source's fields {sorted(src)}; "
                f"found {[s.name for s in firsts]}")
        return firsts[0]


#: the store is looked at after this long without a free or a refresh: often enough to stop a
#: run stuck on a too-small store within seconds (`StoreBackpressure.stall_s` after the first
#: look), and one ``stats`` call a second costs nothing.
_STORE_CHECK_S = 1.0


# ---- request validation (a malformed request is answered with an error and changes nothing) --

#: the most tasks one worker may run at once (a bound on what one registration can claim).
_MAX_CAPACITY = 1024
#: the longest long poll a worker may ask for.
_MAX_WAIT_S = 600.0
#: the restart counter's (and restart queue's) name for the data-parallel trainer group.
_TRAIN_GROUP = "train ranks"
#: the longest wait before a dead worker process is restarted.
_MAX_RESTART_BACKOFF_S = 30.0


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
    if not (type(value) in (int, float) and 0.0 <= value <= _MAX_WAIT_S):  # NaN fails too
        raise ValueError(f"{key!r} must be a number of seconds in [0, {_MAX_WAIT_S}]")
    return float(value)
