"""The controller: one asyncio process that streams micro-batches between stages.

It never touches sample tensors, only their handles. This module wires the controller's parts
(`flowrl.control`): the workers' calls arrive at the `WorkerApi`, which checks them; every call
that changes the state (a task reported or failed, a worker up or down, a new version) wakes the
`Scheduler`, which dispatches whatever became possible into the workers' mailboxes — no loop
ever sleeps to poll. `Admission` decides which groups enter, the `StepLedger` which
micro-batches make a step and when it commits, the `Workforce` keeps the worker processes
alive, the `StoreFeed` frees memory and watches the store.

Its guarantees (exactly-once training, the staleness bound, restarts, bounds on memory and
queues) are stated where they are kept: `flowrl.control.ledger`, `flowrl.staleness`,
`flowrl.control.workforce`, `flowrl.backpressure`; docs/architecture.md puts them together.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from flowrl import messages as m
from flowrl.backpressure import StoreBackpressure
from flowrl.control.admission import Admission
from flowrl.control.assignments import Assignment, Assignments
from flowrl.control.collector import RunCollector
from flowrl.control.evaluation import eval_summary, evaluation_for
from flowrl.control.ledger import LostTrainerState, StepLedger, rank_shares
from flowrl.control.lost_nodes import LostNodes
from flowrl.control.node_leases import NodeLeases, dispatching_nodes
from flowrl.control.reports import TaskReport, check_report
from flowrl.control.run_view import RunCounters, status_snapshot
from flowrl.control.scheduler import ADMIT_AHEAD_CHUNK, Scheduler, find_source_stage
from flowrl.control.stability import StabilityGuard
from flowrl.control.step_metrics import FailureBudget, TooManyFailures
from flowrl.control.store_feed import StoreFeed
from flowrl.control.trace_recorder import TraceRecorder
from flowrl.control.versions import Versions
from flowrl.control.weights import WeightVersions
from flowrl.control.worker_api import WorkerApi
from flowrl.control.workforce import Workforce, rank_rendezvous
from flowrl.dp import StepDivergence
from flowrl.events import EventBus, Span
from flowrl.index import Index, Task
from flowrl.node_hub import ClusterConfig, NodeHub, StoreRouter, relay_heartbeat_s, relay_renew_s
from flowrl.pipeline import PipelineSpec
from flowrl.recipe.stability import StabilityConfig
from flowrl.registry import Registry, WorkerInfo
from flowrl.resume import RunState
from flowrl.run_trace import TraceRecord
from flowrl.staleness import StalenessGate
from transport.endpoints import ipc_endpoint, new_run_id, remove_run_dir
from transport.pubsub import DroppedSubscriber, Publisher
from transport.rpc import RpcClient, RpcServer
from transport.shm import claim_run_dir

if TYPE_CHECKING:
    from pydantic import SecretStr

    from flowrl.monitor import LoopLag, MonitorServer
    from flowrl.recipe import MonitorConfig

log = structlog.get_logger("flowrl.controller")


class RunError(RuntimeError):
    """The run cannot go on (e.g. a pool has no live worker left and cannot be restarted)."""


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
        self.events = EventBus()
        self.index = Index(self.graph)
        self.registry = Registry(spec.heartbeat_timeout_s, tasks_per_slot=1 + spec.prefetch)
        self.gate = StalenessGate(spec.max_staleness, spec.groups_per_step)
        self.admission = Admission(
            self.gate, StoreBackpressure(high_water=spec.store_high_water,
                                         groups_per_step=spec.groups_per_step),
            on_store_pause=self._on_store_pause,
            on_store_refused=lambda: self.store_feed.want_stats())
        self.assignments = Assignments()
        train = next((s for s in self.graph.order if s.consumes_version_bound), None)
        train_pool = spec.pool(train.role) if train else None
        ranks = rank_shares(train, train_pool, spec.groups_per_step)
        self.ledger = StepLedger(self.index, self.admission, ranks=ranks)
        self.weights = WeightVersions()
        self.store_feed = StoreFeed(
            self.admission, self.index, find_source_stage(self.graph).name, spec.group_size,
            version=lambda: self.version, wake=self._wake, progress_mark=self._progress_mark,
            started_tasks=self.assignments.started,
            may_stall=lambda: self._running and not self._paused and self._fatal is None
            and not self._stop.is_set(),
            weights_bytes=lambda: self.weights.nbytes(self.version),
            stalled=lambda error: self._fail_run(RunError(error)))
        #: periodic evaluation on held-out prompts (the recipe's ``eval``); None: none
        self.evaluation = evaluation_for(spec.eval, self.graph, find_source_stage(self.graph))
        self.scheduler = Scheduler(self.graph, self.index, self.registry, self.admission,
                                   self.ledger, self.assignments, group_size=spec.group_size,
                                   send=self._send, free=self.store_feed.free,
                                   evaluation=self.evaluation)
        #: nodes lost mid-run, and the groups whose data was on their stores
        self.lost_nodes = LostNodes(self.index, self.scheduler.drop_group)
        self.api = WorkerApi(self.registry, self.assignments, self,
                             has_role=lambda role: spec.pool(role) is not None, now=self._now,
                             node_token=self._node_token)
        # What this node's agent signs its gathered reports with (`flowrl.node_relay`).
        self._own_node_token = secrets.token_bytes(16)
        #: node-local dispatch (``spec.node_dispatch``); None: every task is dispatched here
        self.node_leases = None if not spec.node_dispatch else NodeLeases(
            self.graph, self.index, self.registry, self.assignments,
            nodes=dispatching_nodes(spec, node),
            reported=functools.partial(self.task_reported, wake=False),
            failed=functools.partial(self.task_failed, wake=False),
            give_back=self.scheduler.fail_task, wake=self._wake,
            now=self._now, scheduler=None if spec.colocated else self.scheduler)
        # Nodes other than this one (pools placed there): their agents meet us at `nodes`.
        remote = {n for p in spec.pools for n in p.nodes} - {node}
        self._hub = None if not remote else NodeHub(
            self.run_id, remote, cluster or ClusterConfig(),
            capacity=spec.store_capacity_bytes, heartbeat_s=relay_heartbeat_s(spec.heartbeat_s),
            renew_s=relay_renew_s(spec.heartbeat_timeout_s),
            on_lost=self._on_node_lost,
            on_exit=lambda *a: self.workforce.on_remote_exit(*a))
        self.workforce = Workforce(
            spec, run_id=self.run_id, node=node, registry=self.registry, events=self.events,
            hub=self._hub,
            rendezvous=rank_rendezvous(spec, self._hub, ranks is not None, train_pool),
            train_role=train.role if train else None, ranked=ranks is not None,
            worker_gone=self.worker_gone, fail_run=lambda e: self._fail_run(RunError(e)),
            stopping=lambda: self._stop.is_set() or self._fatal is not None)
        # run state
        self._running = False  # a run() is in progress
        self._dispatching = False  # a dispatch pass is on the stack (no re-entry)
        self._admitting_ahead = False  # an `_admit_ahead` chunk is scheduled
        self._paused = False
        self._drained_sent = False
        self._changed = asyncio.Event()
        self._waiters = 0  # `wait_for` calls waiting now: only they need a wake per task
        self._stop = asyncio.Event()
        self._steps_target = 0
        self._steps_done = asyncio.Event()
        self._registered = asyncio.Event()
        self._node_up = asyncio.Event()
        self._fatal: BaseException | None = None
        #: the garbage collector while the run is on (frozen at commits, given back at close)
        self.collector = RunCollector()
        self._kick_at = 0.0  # when the dispatch pass running now started (perf_counter)
        self._kick_cpu = 0.0  # and the event loop thread's CPU time then
        self._pass_sent = 0
        self._failures: collections.Counter[tuple[str, int]] = collections.Counter()
        self._owned: list[asyncio.Task[None]] = []
        self._server: RpcServer | None = None
        self._pub: Publisher | None = None
        self._store: RpcClient | None = None
        self._counters = RunCounters()
        #: the stability guard; a spec without settings has one that only carries orders
        self.guard = StabilityGuard(StabilityConfig.model_validate(
            spec.stability if spec.stability is not None else {"enabled": False}))
        self.ledger.orders = self.guard.train_params
        self.versions = Versions(
            self.ledger, self.weights, self.registry, rollout_role=self.scheduler.source.role,
            events=self.events, counters=self._counters, free=self.store_feed.free,
            output=spec.output, guard=self.guard, set_max_staleness=self.set_max_staleness,
            failure_budget=FailureBudget(spec.max_failure_share, spec.max_failure_steps))
        #: called with each step's line (the launcher prints them, the monitor streams them)
        self.on_step = self.versions.on_step
        self.step_log = self.versions.step_log
        #: the run's trace for `flowrl.plan` (`--record-trace`, the monitor's export)
        self.trace = TraceRecorder(
            stage_roles={s.name: s.role for s in self.graph.order},
            pools={p.role: p.count for p in spec.pools}, max_staleness=spec.max_staleness,
            groups_per_step=spec.groups_per_step, group_size=spec.group_size,
            rollout_role=self.scheduler.source.role, now=time.time(), cpu=time.process_time())
        self.on_step.append(lambda e: self.trace.step(e, time.time()))
        #: called with each evaluation round's line (`flowrl.control.evaluation`)
        self.on_eval: list[Callable[[dict[str, Any]], None]] = []
        if self.evaluation is not None:
            ev = self.evaluation
            self.on_step.append(lambda e: ev.committed(e["step"], time.perf_counter()))
            ev.on_record.append(self._evaluated)
        self.dispatch_us: collections.deque[float] = collections.deque(maxlen=100_000)
        #: the same places in the CPU time of the event loop's thread: what the controller's
        #: own work makes a task wait, with a core of its own (`dispatch_us` adds preemption)
        self.dispatch_cpu_us: collections.deque[float] = collections.deque(maxlen=100_000)
        #: tasks each dispatch pass handed out (passes handing out none are not kept): a task's
        #: `dispatch_us` is its place in its pass, so the largest passes set its tail
        self.dispatch_pass_tasks: collections.deque[int] = collections.deque(maxlen=100_000)
        #: µs from an idle rollout worker's `served` report (its entry applied), when a task
        #: formed ahead waited that it may take, to the reply carrying that task sent: what a
        #: worker that loaded a version waits for the controller, the report's other entries,
        #: the pass and the replies sent before its own included (`dispatch_us` starts at the
        #: pass and ends at the task's place in it)
        self.version_wait_us: collections.deque[float] = collections.deque(maxlen=100_000)
        self._idle_since: dict[str, float] = {}  # such a worker -> when it said served
        self.errors: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        #: the HTTP monitor's settings; None runs no monitor.
        self.monitor_config = monitor
        self._monitor: MonitorServer | None = None
        self._lag: LoopLag | None = None
        if resume is not None:
            self.ledger.resume(resume)
            self.admission.resume(resume)

    # ---- what the run counts (read by the launcher, the monitor and tests) -----------------

    @property
    def version(self) -> int:
        """The policy version: optimizer steps committed."""
        return self.ledger.version

    @property
    def rows_trained(self) -> int:
        return self.ledger.rows_trained

    @property
    def rows_trained_twice(self) -> int:
        return self.ledger.rows_trained_twice

    @property
    def stale_dropped(self) -> int:
        return self.scheduler.stale_dropped

    @property
    def restarts(self) -> int:
        return self.workforce.restarts

    @property
    def worker_deaths(self) -> int:
        return self._counters.worker_deaths

    @property
    def eval_log(self) -> list[dict[str, Any]]:
        """One line per evaluation round, in order."""
        return [] if self.evaluation is None else self.evaluation.log

    @property
    def store_stats(self) -> dict[str, Any]:
        return self.store_feed.stats

    @property
    def nodes(self) -> NodeHub | None:
        """Where agents of the other nodes meet this controller (None on one node)."""
        return self._hub

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
        handlers = self.api.handlers()
        # Long polls have a budget of their own: they can never starve heartbeats.
        self._server = RpcServer(ipc_endpoint(self.run_id, "ctl"), handlers,
                                 long_polls=m.LONG_POLLS, tensors=False)
        endpoints = self.workforce.endpoints
        endpoints.controller = await self._server.start()
        hub = self._hub
        self._pub = (Publisher(ipc_endpoint(self.run_id, "pub")) if hub is None
                     else hub.publisher(ipc_endpoint(self.run_id, "pub")))
        self._pub.on_drop = self.workforce.subscriber_dropped
        endpoints.broadcast = await self._pub.start()
        loop = asyncio.get_running_loop()
        self._owned = [loop.create_task(self.store_feed.run(), name="flowrl-free"),
                       loop.create_task(self.workforce.watchdog(self._now),
                                        name="flowrl-watchdog"),
                       loop.create_task(self.versions.broadcast(self._pub),
                                        name="flowrl-publish"),
                       loop.create_task(self.workforce.restart_loop(), name="flowrl-restart"),
                       loop.create_task(self._lag.run(), name="flowrl-loop-lag")]
        if hub is not None:  # other nodes' agents and workers reach us over tcp+curve
            leases = self.node_leases
            if leases is not None:
                self._owned.append(loop.create_task(leases.run(), name="flowrl-leases"))
            self._owned.append(loop.create_task(await self.workforce.open_nodes(
                handlers if leases is None else {**handlers, **leases.handlers()}),
                name="flowrl-nodes"))
        await self.workforce.start_node_agent(self._own_node_token)
        async with asyncio.timeout(self.start_timeout_s):
            await self._node_up.wait()
        if self._fatal is not None:
            raise self._fatal
        if hub is None:
            self._store = RpcClient(endpoints.store)
        else:
            try:
                await hub.wait_ready()
            except RuntimeError as exc:
                raise RunError(str(exc)) from None
            self._store = StoreRouter(endpoints.store, self.node, hub.peers, hub.keys)
        self.store_feed.store = self._store
        await self.workforce.start_pools()
        try:
            await self.workforce.wait_registered(self._registered, self.start_timeout_s,
                                                 failed=lambda: self._fatal)
        except TimeoutError as exc:
            raise RunError(str(exc)) from None
        self.collector.start(self._now())
        # Which loop: uvloop under `flowrl.launch` (`flowrl.lifecycle.run_loop`), a notebook's own.
        loop_kind = type(asyncio.get_running_loop()).__module__.partition(".")[0]
        self._log().info("controller ready", workers=len(self.registry), loop=loop_kind)

    async def aclose(self) -> None:
        """Stop workers, the node agent and the sockets; leaves no process or file behind."""
        self._stop.set()
        if self._monitor is not None:
            await self._monitor.aclose()
        if self._pub is not None:
            await self._pub.publish(m.TOPIC_STOP, {"reason": "controller closing"})
        await self.workforce.stop()
        if self.workforce.rendezvous is not None:
            self.workforce.rendezvous.close()
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
        self.collector.close()

    # ---- running ---------------------------------------------------------------------------

    async def run(self, steps: int, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Run ``steps`` optimizer steps; returns a summary of the run."""
        self._steps_target = self.version + steps
        self._steps_done.clear()
        self._counters.started_at = self.versions.last_step_at = time.perf_counter()
        samples0 = self.ledger.samples_trained
        ev = self.evaluation
        if ev is not None:
            ev.last_step = self._steps_target
        self._running = True
        self._wake()
        try:
            async with asyncio.timeout(timeout_s):
                await self._steps_done.wait()
                if ev is not None and self._fatal is None:  # the last round
                    await self.wait_for(lambda: ev.idle)
        finally:
            self._running = False
            # `wait_for` callers asking whether the run ended (a timeout, a failure) wake up:
            # nothing else changes when only the deadline passes.
            self._changed_now()
        if self._fatal is not None:
            raise self._fatal
        wall = time.perf_counter() - self._counters.started_at
        samples = self.ledger.samples_trained - samples0
        return {"steps": steps, "wall_s": wall, "samples": samples,
                "samples_per_s": samples / wall if wall > 0 else 0.0,
                "version": self.version, "stale_dropped": self.stale_dropped,
                "rows_trained_twice": self.rows_trained_twice,
                "staleness": self.gate.histogram(), **eval_summary(self.eval_log)}

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every task, step, worker event
        and the end of `run`."""
        while not predicate():
            if self._fatal is not None:
                raise self._fatal
            self._waiters += 1
            try:
                await self._changed.wait()
            finally:
                self._waiters -= 1

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
        # Rollout tasks leased ahead wait for a version a paused run does not reach.
        self.scheduler.recall_leased()
        self.events.emit("paused", version=self.version, in_flight=len(self.assignments))
        self._check_drained()
        self._changed_now()

    def resume(self) -> None:
        """Undo `pause`: the scheduler dispatches whatever became possible meanwhile."""
        if not self._paused:
            return
        self._paused = False
        self.events.emit("resumed", version=self.version)
        self._changed_now()
        self._wake()

    def set_max_staleness(self, n: int) -> None:
        """Change the staleness budget; applies to the next admission and train decisions."""
        old = self.gate.max_staleness
        self.gate.set_max_staleness(n)
        if n != old:
            withdrawn = self.scheduler.withdraw_beyond_gate() if n < old else 0
            self.events.emit("staleness", max_staleness=n, previous=old, version=self.version)
            self._log().info("max_staleness changed", max_staleness=n, previous=old,
                             groups_readmitted=withdrawn)
            self._changed_now()
            self._wake()

    def scale_lr(self, factor: float) -> None:
        """Multiply the trainer's learning rate by ``factor`` from the next step none of whose
        micro-batches was handed out yet (the stability guard's own changes compose with it)."""
        self.guard.scale_lr(factor, self.ledger.next_unplaced_step)
        self.events.emit("lr_scale", lr_scale=self.guard.lr_scale, version=self.version)
        self._log().info("learning rate scaled", factor=factor, lr_scale=self.guard.lr_scale)

    def stop(self) -> None:
        """End the current `run` at the last completed step, as if it were its target.

        Nothing new is dispatched; tasks already handed out still report, and a step they
        complete still commits (its rows are trained, not lost), so `version` may move past
        the version in the summary `run` returned."""
        self._steps_target = self.version
        if self.evaluation is not None:  # no round waits for a stopped run
            self.store_feed.free(self.evaluation.abandon())
        self.events.emit("stopping", version=self.version)
        self._steps_done.set()
        self._changed_now()

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

    def plan_trace(self) -> tuple[dict[str, Any], list[TraceRecord]]:
        return self.trace.header(now=time.time(), cpu=time.process_time()), list(
            self.trace.records)

    def _log(self) -> Any:
        """The controller's logger with the context every line carries."""
        return log.bind(run_id=self.run_id, role="controller", version=self.version)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _changed_now(self) -> None:
        """Wake `wait_for` callers: the run's state changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- dispatch --------------------------------------------------------------------------

    def _wake(self) -> None:
        """Something changed: dispatch whatever became possible, at once and inline.

        Every caller is an event (a report, a death, a new version), so the scheduler never
        polls; a pass costs O(stages + tasks dispatched + open workers), cheap enough to run in
        the handler itself, which keeps dispatch latency free of event-loop queueing.
        """
        if (not self._running or self._dispatching or self._stop.is_set()
                or self._fatal is not None):
            return
        if self._paused:
            self._check_drained()
            return
        self._dispatching = True
        self._kick_at = now = time.perf_counter()
        self._kick_cpu = time.thread_time()
        self._pass_sent = 0
        try:
            self.lost_nodes.sweep()
            self.scheduler.dispatch(steps_target=self._steps_target, now=now)
            if self.node_leases is not None:
                self.node_leases.dispatch(now)
            if self.scheduler.may_admit_ahead and not self._admitting_ahead:
                self._admitting_ahead = True
                asyncio.get_running_loop().call_soon(self._admit_ahead)
        except Exception as exc:  # a scheduler bug must stop the run loudly, not a worker's call
            self._log().exception("dispatch failed")
            self._fail_run(RunError(f"dispatch failed: {exc!r}"))
        finally:
            self._dispatching = False
            if self._pass_sent:
                self.dispatch_pass_tasks.append(self._pass_sent)
            if self._idle_since and not self.scheduler.formed_for(self.version):
                self._idle_since.clear()  # the formed tasks went to others: none waits now

    def _admit_ahead(self) -> None:
        """Admit the groups no worker may generate yet (the gate's, or one step past it:
        `Scheduler.admit_ahead`), a few at a time, so that reports keep being handled between
        the chunks."""
        self._admitting_ahead = False
        if (not self._running or self._paused or self._stop.is_set()
                or self._fatal is not None or not self.scheduler.may_admit_ahead):
            return
        try:
            admitted = self.scheduler.admit_ahead(
                steps_target=self._steps_target, now=time.perf_counter(), up_to=ADMIT_AHEAD_CHUNK)
        except Exception as exc:  # as in `_wake`: a scheduler bug stops the run loudly
            self._log().exception("admission failed")
            self._fail_run(RunError(f"admission failed: {exc!r}"))
            return
        if self.scheduler.formed_for(self.version) or (
                admitted and self.scheduler.recall is not None):
            # A task it formed may go now: a worker loaded the version meanwhile, or the gate
            # moved (a bound raised) and the chunk took groups of the gate's own steps; or node
            # agents take rollout tasks, which they hold until their workers may run them. The
            # pass may schedule the next chunk itself.
            self._wake()
        if admitted == ADMIT_AHEAD_CHUNK and not self._admitting_ahead:
            self._admitting_ahead = True
            asyncio.get_running_loop().call_soon(self._admit_ahead)

    def _check_drained(self) -> None:
        if self._paused and not self.assignments and not self._drained_sent:
            self._drained_sent = True
            self.events.emit("drained", version=self.version)
            self._changed_now()  # `wait_for` callers waiting for the drain

    def _send(self, w: WorkerInfo, a: Assignment) -> None:
        """The scheduler's output: ``a`` goes to its worker's mailbox."""
        if self._kick_at:
            self.dispatch_us.append((time.perf_counter() - self._kick_at) * 1e6)
            self.dispatch_cpu_us.append((time.thread_time() - self._kick_cpu) * 1e6)
        self._pass_sent += 1
        since = self._idle_since.pop(w.worker_id, None)
        if since is not None and a.task.stage == self.scheduler.source.name:
            waits = self.version_wait_us
            self.api.deliver(w.worker_id, a, lambda: waits.append(
                (time.perf_counter() - since) * 1e6))
        else:
            self.api.deliver(w.worker_id, a)

    # ---- what workers report (`WorkerApi` calls these once a call passed its checks) -------

    def worker_registered(self, info: WorkerInfo) -> dict[str, Any]:
        if self.node_leases is not None:  # before any pass could pick it
            self.node_leases.registered(info)
        latest = self.weights.get(self.version)
        # Without published weights of the current version (the run's start, or a resume
        # before its first step) the model every worker loads *is* that version; otherwise
        # the worker serves it once it has loaded the weights and said so (`served`).
        info.version = self.version if latest is None else 0
        self._registered.set()
        self._wake()
        self._log().info("worker up", worker=info.worker_id, name=info.name, node=info.node)
        self.events.emit("worker_up", worker=info.worker_id, role=info.role, node=info.node,
                         name=info.name)
        self._changed_now()  # `wait_for` predicates may ask for a worker (a restarted one)
        return {"worker_id": info.worker_id, "token": info.token, "version": self.version,
                "weights": latest}

    def task_reported(self, a: Assignment, report: TaskReport, *, wake: bool = True) -> None:
        """A task finished; its report was parsed. Checked against the task before anything
        changes (`flowrl.control.reports` raises `MalformedReport`, which fails the task).
        ``wake=False``: no dispatch pass (the caller runs one for a batch of reports)."""
        task = a.task
        if self.evaluation is not None and self.evaluation.owns(task.id):
            self._finish(a, ok=True)
            self.store_feed.free(self.evaluation.reported(task.id, report, time.perf_counter()))
            self._check_drained()
            if wake:
                self._wake()
            return
        train = self.scheduler.is_train(task)
        check_report(report, task, self.graph.stage(task.stage), train=train)
        self._finish(a, ok=True)
        self.trace.task(a.worker, task.stage, len(task.rows), a.started_at, report.lengths,
                        bool(a.params.get("step_end")), time.time())
        if train:
            try:
                ready = self.ledger.trained(task, a.params, report.raw)
            except StepDivergence as exc:
                self._fail_run(RunError(str(exc)))
                return
            for tasks, step_report in ready:
                self._commit(tasks, step_report)
        else:
            retired = self.index.complete(task.id, report.fields, version=report.version,
                                          lengths=report.lengths or None)
            self.store_feed.free(retired)
            self.versions.stage_metrics.fold(task, report)
        self._check_drained()  # after the report's step committed: "drained" says its version
        if wake:
            self._wake()

    def task_failed(self, a: Assignment, error: str, *, wake: bool = True) -> None:
        """A task failed (``wake`` as in `task_reported`)."""
        self._finish(a, ok=False)
        task = a.task
        record = {"worker": a.worker, "stage": task.stage, "task": task.id,
                  "version": self.version, "error": error}
        self.errors.append(record)
        self.events.emit("error", **record)
        key = (task.stage, task.rows[0] if task.rows else -1)
        self._failures[key] += 1
        if self._failures[key] >= self.spec.max_task_failures:
            self._fail_run(RunError(
                f"stage {task.stage!r} failed {self._failures[key]} times on rows "
                f"starting at {key[1]} (last on worker {a.worker}, policy version "
                f"{self.version}): {error}"))
        if self.scheduler.is_train(task):
            self._abort_step([task])
            rank = self.registry.get(a.worker)
            if self.ledger.ranks is not None and rank is not None:
                # The group's collectives may be out of step now (a pass that failed half-way,
                # a peer that died): only a fresh group is sure to pair them up again.
                self.workforce.group_down(rank.name, f"failed a micro-batch of step "
                                                f"{a.params.get('step')}: {error}")
        else:
            self.scheduler.fail_task(task.id)
        self._check_drained()
        if wake:
            self._wake()

    def workers_serve(self, served: list[tuple[WorkerInfo, int]],
                      interrupted: list[tuple[WorkerInfo, int, int]]) -> None:
        """Workers' ``served`` reports (a node's gathered ones, or one worker's), each
        ``(worker, version)``: one release and one dispatch pass for all. ``interrupted``:
        ``(worker, tasks, sequences)`` of those that loaded the version while tasks ran, which
        continue under it (rollout.partial)."""
        self.registry.serve(served)
        now = time.perf_counter()
        source = self.scheduler.source.role
        formed_for = self.scheduler.formed_for
        idle_since = self._idle_since
        for info, version in served:
            if (not info.tasks and not info.leased and info.role == source
                    and formed_for(version)):
                idle_since[info.worker_id] = now
        self.trace.served(served, time.time())
        for info, tasks, sequences in interrupted:
            detail = {"version": info.version, "tasks": tasks, "sequences": sequences}
            self.events.emit("interrupted", worker=info.worker_id, **detail)
            self.events.mark(info.worker_id, info.role, "interrupted", **detail)
        self.versions.release_unserved()
        self._wake()

    def node_dropped(self, node: str, dropped: DroppedSubscriber) -> None:
        self.workforce.subscriber_dropped(dropped, node=node)

    def _node_token(self, node: str) -> bytes | None:
        if node == self.node:
            return self._own_node_token
        return None if self._hub is None else self._hub.token(node)

    def sync_failed(self, info: WorkerInfo, version: int, error: str) -> None:
        record: dict[str, Any] = {
            "worker": info.worker_id, "name": info.name, "node": info.node,
            "stage": "weight_sync", "version": version, "served": info.version, "error": error}
        self.errors.append(record)
        self.events.emit("error", **record)
        self._log().error("weight sync failed", **record)
        self.workforce.last_error[info.process] = error

    def start_failed(self, process: str, token: str, error: str) -> None:
        self.workforce.start_failed(process, token, error)

    def node_up(self, store: str, peer_store: str | None, relay: tuple[str, str] | None = None
                ) -> bool:
        if self._node_up.is_set():  # the agent reports once: a replay must not move the store
            return False
        self.workforce.endpoints.store = store
        if relay is not None:  # this node's workers hear broadcasts and report through it
            self.workforce.endpoints.broadcast, self.workforce.endpoints.relay = relay
        if self._hub is not None and peer_store:
            self._hub.add_peer(self.node, peer_store)
        self._node_up.set()
        return True

    def worker_gone(self, worker_id: str, why: str) -> None:
        """A worker left (exit, missed heartbeats, bye): its tasks are redone by others; a
        trainer's whole step is redone."""
        info = self.registry.remove(worker_id)
        if info is None:
            return
        self._idle_since.pop(worker_id, None)
        if self.node_leases is not None:
            self.node_leases.gone(info)
        if not self._stop.is_set():
            self._counters.worker_deaths += 1
            self._log().warning("worker down", worker=worker_id, name=info.name, why=why,
                                tasks=len(info.tasks))
            self.errors.append({"worker": worker_id, "error": f"worker down: {why}"})
            self.events.emit("worker_down", worker=worker_id, role=info.role, why=why)
            self._changed_now()
        self.api.close_mailbox(worker_id)
        lost_train: list[Task] = []
        for task_id in list(info.tasks):
            a = self.assignments.pop(task_id)
            if a is None:
                continue
            if self.scheduler.is_train(a.task):
                lost_train.append(a.task)
            else:
                self.scheduler.fail_task(task_id)
        train = self.scheduler.train
        if train is not None and info.role == train.role:
            self._abort_step(lost_train)
            if self.ledger.ranks is not None and not self._stop.is_set():
                self.workforce.group_down(info.name, why)
        self._wake()

    def _finish(self, a: Assignment, *, ok: bool) -> None:
        info = self.registry.get(a.worker)
        if info is not None:
            self.registry.finish(info, a.task.id, ok=ok)
        self.assignments.pop(a.task.id)
        if a.started_at:
            self.events.span(Span(a.worker, info.role if info else "", a.task.stage, a.task.id,
                                  len(a.task.rows), a.started_at, time.time()))
        if self._waiters:
            self._changed_now()

    def _abort_step(self, lost: list[Task]) -> None:
        """The trainer lost its accumulated gradients: redo every micro-batch of the step."""
        train = self.scheduler.train
        assert train is not None
        in_flight = [self.assignments.pop(t) for t in self.assignments.of_stage(train.name)]
        for task in [*lost, *self.ledger.abort(), *(a.task for a in in_flight if a)]:
            self.scheduler.fail_task(task.id)
        for w in self.registry.of_role(train.role):
            for task_id in list(w.tasks):
                self.registry.finish(w, task_id, ok=False)
            self.api.empty_mailbox(w.worker_id)

    # ---- steps -----------------------------------------------------------------------------

    def _commit(self, tasks: list[Task], report: dict[str, Any]) -> None:
        """All micro-batches of a step are trained: commit them and publish the new version."""
        try:
            self.versions.commit(tasks, report)
        except (LostTrainerState, TooManyFailures) as exc:
            self._fail_run(RunError(str(exc)))
            return
        self.collector.committed(self._now())
        if self.version >= self._steps_target:
            self._steps_done.set()
        self._changed_now()

    def _evaluated(self, line: dict[str, Any]) -> None:
        """An evaluation round ended: said, streamed, and handed to ``on_eval``."""
        self._log().info("evaluated", **line)
        self.events.emit("eval", **line)
        for callback in self.on_eval:
            callback(line)
        self._changed_now()

    def run_state(self) -> RunState:
        """What `--resume` needs to continue from this version (see `flowrl.resume`)."""
        return self.ledger.run_state()

    # ---- failures --------------------------------------------------------------------------

    def _on_node_lost(self, node: str) -> None:
        """``node``'s agent stopped answering: its workers and its store's data are gone. The
        run goes on without them when it can (`flowrl.control.lost_nodes`)."""
        if self.node_leases is not None:
            self.node_leases.node_gone(node)
        if self._stop.is_set():
            return
        why = self.workforce.node_lost(node)
        for info in [w for w in self.registry.all() if w.node == node]:
            self.worker_gone(info.worker_id, f"its node agent {node!r} stopped answering")
        if why is not None:
            self._fail_run(RunError(f"node agent {node!r} stopped answering and {why}"))
            return
        self.versions.announce(m.TOPIC_NODE_LOST, {"node": node})  # workers stop reading it
        held = self.lost_nodes.lost(node)
        self._log().warning("node lost; the run goes on without it", node=node,
                            groups_with_lost_data=held, dropped=self.lost_nodes.groups_dropped)
        self.errors.append({"node": node, "error": f"node agent {node!r} stopped answering; "
                            f"{held} groups had data there"})
        self.events.emit("node_lost", node=node, groups=held)
        self._changed_now()
        self._wake()

    def _fail_run(self, error: RunError) -> None:
        """Stop the run with ``error``: every waiter wakes up and raises it."""
        if self._fatal is None:
            self._log().error("run failed", error=str(error))
            self.events.emit("run_failed", error=str(error))
            self._fatal = error
        self._registered.set()
        self._steps_done.set()
        self._node_up.set()
        self._changed_now()

    # ---- the store (`flowrl.control.store_feed` feeds `flowrl.backpressure`) ---------------

    def _on_store_pause(self, paused: bool) -> None:
        if paused:
            self.events.emit("store_paused", version=self.version,
                             **self.admission.store.statistics(time.perf_counter()))
        else:
            self.events.emit("store_resumed", version=self.version)

    def _progress_mark(self) -> tuple[int, ...]:
        """Changes whenever the run moves: a task starts or ends, a step commits, a group is
        admitted, a worker comes or goes, memory is freed."""
        ended = sum(w.done + w.failed for w in self.registry.all())
        return (self.version, ended, self.assignments.started(), len(self.registry),
                len(self.assignments), self.worker_deaths, self.restarts,
                self.admission.admitted, self.admission.store.free_batches)

    # ---- introspection ---------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot of the run: exactly what the monitor's ``GET /status`` serves."""
        return status_snapshot(
            run_id=self.run_id, graph=self.graph, index=self.index, registry=self.registry,
            assignments=self.assignments, admission=self.admission, ledger=self.ledger,
            step_log=self.step_log, steps_target=self._steps_target, paused=self._paused,
            stale_dropped=self.stale_dropped, store_stats=self.store_stats,
            counters=self._counters, restarts=self.restarts, errors=list(self.errors),
            lag=self._lag, events=self.events, monitor_url=self.monitor_url,
            eval_log=self.eval_log, lost_nodes=self.lost_nodes,
            leases=None if self.node_leases is None else self.node_leases.statistics())

    def kill_worker_process(self, pid: int) -> None:
        """SIGKILL one child (tests and chaos use this)."""
        self.workforce.kill(pid)

    def worker_pids(self, role: str | None = None) -> list[int]:
        return sorted({w.pid for w in self.registry.all() if role in (None, w.role)})
