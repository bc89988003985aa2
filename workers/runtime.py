"""The worker runtime: one coroutine-driven worker talking to the controller.

A worker registers (role, node, capacity), then runs three owned loops until stopped:

- *pull*: ``capacity`` long-poll ``get_task`` calls; each task's inputs are read from the store
  (zero-copy on the same node, through the owning node's store server otherwise), the role runs,
  its outputs go into this node's store, and the next ``get_task`` carries the report of the new
  fields' handles (``task_done`` on its own only when the worker stops holding one);
- *heartbeat*: one small request per ``heartbeat_s``, so a worker that is busy computing is never
  mistaken for a dead one (compute runs off the event loop, in the role's own thread or engine);
- *broadcast*: listens for new policy versions and for ``stop`` (on a node agent's relay, which
  also takes the heartbeats and the ``served`` report of each version loaded:
  `flowrl.node_relay`).

With ``WorkerConfig.tasks`` the *pull* loop's calls go to that endpoint instead (a node agent
that dispatches this worker's stage, `flowrl.node_dispatch`); everything else still goes to the
controller.

A new policy version is applied at a safe point: new tasks wait while the role loads the weights,
and loading waits for tasks in flight to finish, so no task ever sees two versions. New tasks
wait from the moment the version arrives: a worker of several tasks at once (``capacity``) that
went on starting them might never be idle to load it. A role that
sets ``interruptible`` (episodes with ``rollout.partial``) loads it while its tasks run, between
two decode steps, and says how many running sequences continue under it: the ``served`` report
then carries how many tasks were running (``interrupted``) and that count (``continued``).

Several workers may share one process (simulation mode hosts many); each has its own sockets.

Every call after ``register`` carries the worker id and the token of the register reply.

A controller that sends malformed messages: a register reply that is not
``{worker_id: str, token?: bytes, version: int, weights}`` is fatal (`ProtocolError`: the
worker cannot take part without an id); anything later is logged and dropped, and the worker
goes on — a task message of the wrong shape (reported ``task_failed`` when it carries a task
id, so its rows are redone), an error reply to ``get_task`` (asked again after `RETRY_S`), a
heartbeat reply other than ``{ok: bool}``, a broadcast of the wrong shape, a version whose
weights cannot be loaded (the worker keeps serving its version, which its heartbeats report).
Only ``{ok: False}`` or a ``stop`` broadcast ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog
import torch

from flowrl import messages as m
from transport.curve import CurveKeys, for_endpoint
from transport.errors import ClosedError, DeadlineExceeded, TransportError
from transport.handles import (
    Handle,
    handle_to_wire,
    is_handle,
    rows_from_wire,
    run_to_wire,
    to_wire,
)
from transport.pubsub import Subscriber
from transport.rpc import RpcClient

log = structlog.get_logger("flowrl.worker")

#: pause before asking again after an error reply, so a failing controller is not flooded.
RETRY_S = 0.1

_T = TypeVar("_T")


class ProtocolError(RuntimeError):
    """The controller answered with a message this worker cannot act on."""


class WeightSyncError(RuntimeError):
    """A policy version was not loaded within ``weight_sync_timeout_s``. The engine may hold
    half-loaded weights, so the worker must not serve again: its process exits."""


@dataclass
class RoleOutput:
    """What a role returns for one task."""

    #: field name -> one value per row: a tensor (goes to the store) or a scalar (travels inline).
    fields: dict[str, list[Any]]
    lengths: list[int] = field(default_factory=list)
    version: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: set when this task ends a train step: the new weights, published as version + 1.
    weights: dict[str, torch.Tensor] | None = None
    #: instead of `weights`: the new weights as the role already wrote them into the store,
    #: bucket by bucket (through the `WeightPublisher` its ``bind_weight_publisher`` got),
    #: in `publish_weights`'s form.
    published: dict[str, list[Any]] | None = None
    #: failure kind -> the rows (offsets into the task's rows) whose values are fallbacks.
    failed: dict[str, m.FailedRows] = field(default_factory=dict)


class Role(Protocol):
    """What a worker runs. Heavy compute must not block the event loop.

    A role whose class sets ``loads_weights = False`` (reward, reference, critic) does not
    serve the policy: new versions neither fetch weights nor pause its tasks at a safe point.
    A role with an ``async def aclose()`` has it awaited when its worker process stops (to stop
    what it started, such as tool sandboxes). A role with a ``bind_weight_publisher(publish)``
    gets a `WeightPublisher` before its first task, to write weights into the store from its
    compute thread (a bucketed export: `RoleOutput.published`).
    """

    async def run(self, task: m.TaskMsg, inputs: dict[str, list[Any]]) -> RoleOutput: ...

    async def load_version(self, version: int, weights: dict[str, torch.Tensor]) -> int | None:
        """Serve ``version`` from now on. ``weights`` (empty when there is nothing to load)
        are read-only views of the store, unchanged and alive until this worker reports
        serving a later version: a role may keep them rather than copy them. An
        ``interruptible`` role returns how many running sequences continue under it."""
        ...


class Store(Protocol):
    """The node store as seen by a worker (see `transport.store_client.StoreClient`)."""

    async def put(
        self, fields: Mapping[str, Sequence[torch.Tensor]], *, spare: bool | None = None
    ) -> dict[str, list[Any]]: ...

    async def get(self, handles: Sequence[Handle]) -> list[torch.Tensor]: ...

    async def get_readonly(self, handles: Sequence[Handle]) -> list[torch.Tensor]: ...

    async def free(self, handles: Sequence[Handle]) -> None: ...

    async def lose_node(self, node: str) -> None: ...


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    role: str
    node: str
    controller: str
    broadcast: str
    #: tasks this worker runs concurrently (each is one outstanding long poll).
    capacity: int = 1
    heartbeat_s: float = 1.0
    #: how long one ``get_task`` long poll waits before asking again. An idle worker's poll
    #: that ends empty is pure cost to the controller (a request and its reply), paid per idle
    #: worker per ``poll_s``: at a thousand workers, 5 s cost ~200 requests a second.
    #: Liveness rides on heartbeats and a report on the next poll, so a long wait loses nothing.
    poll_s: float = 30.0
    rpc_timeout_s: float = 30.0
    #: the run's curve keys (a run across nodes), used on tcp links to the controller.
    curve: CurveKeys | None = None
    #: deadline for fetching and loading one policy version (the wait for a safe point before
    #: it is not counted: a long generation may delay a switch legitimately).
    weight_sync_timeout_s: float = 60.0
    #: where to poll for tasks and report them (``get_task``, ``task_done``, ``task_failed``)
    #: when not the controller: the node agent that dispatches this worker's stage
    #: (`flowrl.node_dispatch`). Everything else still goes to the controller.
    tasks: str | None = None
    #: where ``served`` and heartbeats go: its node agent's relay, which gathers the node's
    #: into one message (`flowrl.node_relay`); "": straight to the controller.
    relay: str = ""


#: weights up to this size are published with a spare grant for the next version (see below).
SPARE_WEIGHTS_MAX = 64 << 20


async def publish_weights(
    store: Store, weights: Mapping[str, torch.Tensor]
) -> dict[str, list[Any]]:
    """Write ``weights`` into the store; name → ``[handle, shape]`` (what the controller keeps
    and broadcasts).

    One put with one field per dtype and one row per tensor: the tensors are packed into one
    segment with one copy, and the handles of a field form one contiguous run, so the reader
    maps it once. (A field per tensor would cost a plan, a copy call and a run per tensor.)
    """
    if not weights:  # served in place (colocated placement): nothing to write
        return {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, w in weights.items():
        by_dtype.setdefault(w.dtype, []).append(name)
    groups = {f"weights.{i}": names for i, names in enumerate(by_dtype.values())}
    # A spare grant saves the next version a round trip; for a large model it would keep a
    # second model-sized segment reserved (and mapped) between steps, while the next version
    # reuses this one's pooled segment anyway.
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())
    handles = await store.put(
        {key: [weights[n].reshape(-1) for n in names] for key, names in groups.items()},
        spare=nbytes <= SPARE_WEIGHTS_MAX)
    return {n: [handle_to_wire(h), list(weights[n].shape)]
            for key, names in groups.items() for n, h in zip(names, handles[key], strict=True)}


class WeightPublisher:
    """`publish_weights` callable from a role's compute thread: each call runs on the
    worker's event loop and returns its handles. Weights published in several calls (one per
    bucket) are one version: their handles merged are what one call on them all returns, so
    the rollout workers load them as before."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop

    def __call__(self, weights: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
        return self._call(publish_weights(self._store, weights))

    def discard(self, published: Mapping[str, Any]) -> None:
        """Free weights published here that will not make a version (a bucketed export that
        failed part way): their memory would otherwise stay taken until the run ends."""
        handles = [Handle.from_wire(published[n][0]) for n in published]
        if handles:
            self._call(self._store.free(handles))

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no running loop: a compute thread, as meant
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("WeightPublisher called on its own event loop: it would wait "
                               "for itself")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


async def fetch_weights(store: Store, wire: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors `publish_weights` wrote, as read-only views of the store's memory (no copy,
    and no page fault once the store recycles weight segments this process has seen)."""
    names = list(wire)
    if not names:
        return {}
    flat = await store.get_readonly([Handle.from_wire(wire[n][0]) for n in names])
    return {n: t.view(*wire[n][1]) for n, t in zip(names, flat, strict=True)}


class WeightFetches:
    """One fetch of a version's weights for all the workers one process hosts.

    Every worker loads each version it is told of; with many workers in a process (simulated
    ones, small engines) each fetching on its own would make one store round trip a worker, and
    a read of the whole version from the trainer's node for each one on another node. Here the
    first worker to ask starts the fetch and the others share its result (read-only tensors,
    as `fetch_weights` returns them). The fetch is kept until every worker has taken it, or a
    newer version is asked for (a worker that skips a version never takes it), so at most one
    version's tensors are held beyond their loads. A process of one worker keeps nothing.
    """

    def __init__(self, store: Store, workers: int) -> None:
        self.store = store
        self.workers = workers
        #: fetches started, and asks answered by a fetch another worker started
        self.started = 0
        self.shared = 0
        self._version = -1
        self._wire: Mapping[str, Any] = {}
        self._fetch: asyncio.Future[dict[str, torch.Tensor]] | None = None
        self._takers = 0

    async def fetch(self, version: int, wire: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``version``'s tensors, as `publish_weights` described them in ``wire``."""
        if self.workers <= 1:
            self.started += 1
            return await fetch_weights(self.store, wire)
        shared = self._fetch
        if shared is None or version != self._version or wire != self._wire:
            shared = self._fetch = asyncio.ensure_future(fetch_weights(self.store, wire))
            shared.add_done_callback(self._ended)
            self._version, self._wire, self._takers = version, wire, 0
            self.started += 1
        else:
            self.shared += 1
        self._takers += 1
        if self._takers >= self.workers:  # the last to take it: nothing is held after
            self._fetch = None
        # One worker's deadline or stop cancels its own wait, never the others' fetch.
        return await asyncio.shield(shared)

    def _ended(self, fetch: asyncio.Future[dict[str, torch.Tensor]]) -> None:
        if not fetch.cancelled() and fetch.exception() is not None and self._fetch is fetch:
            self._fetch = None  # a failed fetch is not shared by the workers that ask later


class ServedReports:
    """The ``served`` reports of the workers one process hosts, to their node's relay: those
    made in one turn of the event loop leave in one ``served_many`` request.

    At a version switch every idle worker of a process loads the version in the same turn
    (they share one fetch: `WeightFetches`) and reports it, so the relay takes a request a
    process and version where it took one a worker. Each report returns once its request is
    answered, and raises what the request raised.
    """

    def __init__(self, relay: RpcClient) -> None:
        """``relay``: a client of the node's relay (its ``served`` endpoint); not closed here."""
        self.relay = relay
        #: ``served_many`` requests sent
        self.requests = 0
        self._batch: list[dict[str, Any]] = []
        self._next: asyncio.Future[None] | None = None

    async def report(self, served: dict[str, Any]) -> None:
        """Send ``served`` (a worker's report: its id, token and version) with the others of
        this turn."""
        if self._next is None:
            self._batch = []
            self._next = asyncio.ensure_future(self._send())
            # A request whose every reporter gave up waiting still ends; its error is not news.
            self._next.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._batch.append(served)
        # One worker's stop cancels its own wait, never the request the others wait on.
        await asyncio.shield(self._next)

    async def _send(self) -> None:
        # First run after the reports of the turn that started it: later ones start another.
        batch, self._next = self._batch, None
        for i in range(0, len(batch), m.MAX_NODE_SERVED):
            self.requests += 1
            await self.relay.call(m.OP_SERVED_MANY, {"reports": batch[i:i + m.MAX_NODE_SERVED]})


class Worker:
    def __init__(self, config: WorkerConfig, role: Role, store: Store,
                 weights: WeightFetches | None = None,
                 served: ServedReports | None = None) -> None:
        """``weights`` and ``served``: shared by the workers of one process (`WeightFetches`,
        `ServedReports`); by default this worker's own."""
        self.config = config
        self.role = role
        self.store = store
        self.weights = WeightFetches(store, 1) if weights is None else weights
        self.worker_id = ""
        # worker_id and the token of the register reply: what every later call carries
        self._me: dict[str, Any] = {}
        self.version = 0
        self._rpc = RpcClient(config.controller, timeout=config.rpc_timeout_s,
                              curve=for_endpoint(config.curve, config.controller))
        # Tasks' calls: to the controller, or to this node's agent when it dispatches them.
        self._tasks = (self._rpc if config.tasks is None else
                       RpcClient(config.tasks, timeout=config.rpc_timeout_s,
                                 curve=for_endpoint(config.curve, config.tasks)))
        # Where ``served`` and heartbeats go. The relay is on this node (ipc): no curve.
        self._relay_rpc = (RpcClient(config.relay, timeout=config.rpc_timeout_s)
                            if config.relay else self._rpc)
        # Without a relay, the controller takes each worker's ``served`` by itself.
        self._served: ServedReports | None = None
        if config.relay:
            self._served = ServedReports(self._relay_rpc) if served is None else served
        self._sub = Subscriber(config.broadcast, list(m.WORKER_TOPICS), name=config.name,
                               curve=for_endpoint(config.curve, config.broadcast))
        self._stopped = asyncio.Event()
        self._idle = asyncio.Event()  # set when no task is in flight
        self._idle.set()
        self._gate = asyncio.Event()  # cleared while a new version is being loaded
        self._gate.set()
        self._in_flight = 0
        self.tasks_done = 0

    async def run(self) -> None:
        """Register, serve tasks until ``stop`` (or the controller forgets us), then say bye."""
        cfg = self.config
        await self._sub.join(timeout=cfg.rpc_timeout_s)
        bind = getattr(self.role, "bind_weight_publisher", None)
        if callable(bind):
            bind(WeightPublisher(self.store, asyncio.get_running_loop()))
        reply = await self._rpc.call(
            m.OP_REGISTER,
            {"name": cfg.name, "role": cfg.role, "node": cfg.node, "pid": os.getpid(),
             "capacity": cfg.capacity},
        )
        if not _is_register_reply(reply):
            raise ProtocolError(f"the controller sent an invalid register reply: {reply!r:.200}")
        self.worker_id = reply["worker_id"]
        self._me = {"worker_id": self.worker_id, "token": reply.get("token")}
        if reply.get("weights"):  # join at the version everyone else serves
            await self._switch_version(int(reply["version"]), reply["weights"])
        elif int(reply["version"]) > 0:
            await self.role.load_version(int(reply["version"]), {})
            self.version = int(reply["version"])
        self._log().debug("worker registered", worker=self.worker_id, role=cfg.role, node=cfg.node)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._broadcasts())
                tg.create_task(self._heartbeats())
                for _ in range(cfg.capacity):
                    tg.create_task(self._pull())
                await self._stopped.wait()
                raise _Stop
        except* _Stop:
            pass
        finally:
            with contextlib.suppress(TransportError):
                await self._rpc.call(m.OP_BYE, self._me, timeout=2.0)
            await self.aclose()

    def _log(self) -> Any:
        """This worker's logger with the context every line carries."""
        return log.bind(worker=self.worker_id, role=self.config.role, version=self.version)

    def stop(self) -> None:
        self._stopped.set()

    async def aclose(self) -> None:
        await self._sub.aclose()
        if self._tasks is not self._rpc:
            await self._tasks.aclose()
        await self._rpc.aclose()
        if self._relay_rpc is not self._rpc:
            await self._relay_rpc.aclose()

    async def _pull(self) -> None:
        cfg = self.config
        # The last task's report rides on the next poll (one round trip per task). It is sent
        # again until a poll went through: the controller ignores a report it already took.
        done: m.DoneMsg | None = None
        try:
            while not self._stopped.is_set():
                request: dict[str, Any] = {**self._me, "wait_s": cfg.poll_s}
                if done is not None:
                    request["done"] = done
                try:
                    task = await self._tasks.call(m.OP_GET_TASK, request,
                                                timeout=cfg.poll_s + cfg.rpc_timeout_s)
                except (ClosedError, DeadlineExceeded):
                    continue
                except TransportError as exc:  # an error reply: ask again, a little later
                    self._log().warning("get_task failed", error=repr(exc)[:200])
                    await self._rest(RETRY_S)
                    continue
                done = None
                if task is None:
                    continue
                if not _is_task(task):
                    await self._refuse(task)
                    continue
                done = await self._execute(task)
        finally:
            if done is not None:  # stopping with a report not yet sent: send it on its own
                with contextlib.suppress(TransportError, asyncio.CancelledError):
                    await asyncio.shield(self._tasks.call(m.OP_TASK_DONE, {**done, **self._me},
                                                        timeout=2.0))

    async def _refuse(self, task: Any) -> None:
        """Drop a malformed task message; if it names a task, report it failed (its rows are
        then given to another worker)."""
        self._log().warning("dropped a malformed task", task=repr(task)[:200])
        task_id = task.get("task_id") if isinstance(task, dict) else None
        if type(task_id) is int:
            with contextlib.suppress(TransportError):
                await self._tasks.call(m.OP_TASK_FAILED, {
                    **self._me, "task_id": task_id,
                    "error": "malformed task message"})

    async def _rest(self, seconds: float) -> None:
        """Wait `seconds`, or less if the worker stops meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopped.wait()

    async def _execute(self, task: m.TaskMsg) -> m.DoneMsg | None:
        """Run `task`; its report (sent with the next poll), or None if it failed (reported)."""
        await self._gate.wait()  # a version switch in progress finishes first
        self._in_flight += 1
        self._idle.clear()
        try:
            inputs = await self._read_inputs(task["inputs"])
            out = await self.role.run(task, inputs)
            done = await self._write_outputs(task, out)
            self.tasks_done += 1
            return done
        except (asyncio.CancelledError, ClosedError):
            raise
        except Exception as exc:  # the controller requeues the rows; we keep serving
            self._log().warning("task failed", worker=self.worker_id, task=task["task_id"],
                        stage=task["stage"], error=repr(exc))
            with contextlib.suppress(TransportError):
                await self._tasks.call(
                    m.OP_TASK_FAILED,
                    {**self._me, "task_id": task["task_id"], "error": repr(exc)},
                )
            return None
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _read_inputs(self, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for name, values in inputs.items():
            if values and is_handle(values[0]):
                out[name] = await self.store.get(rows_from_wire(values))
            else:
                out[name] = list(values)
        return out

    async def _write_outputs(self, task: m.TaskMsg, out: RoleOutput) -> m.DoneMsg:
        tensors = {k: v for k, v in out.fields.items() if v and isinstance(v[0], torch.Tensor)}
        fields: dict[str, Any] = {k: list(v) for k, v in out.fields.items() if k not in tensors}
        if tensors:
            # A field's rows of one put leave as one run where they can (the controller then
            # checks one value, not a handle a row).
            fields.update({k: run_to_wire(hs) or to_wire(hs)
                           for k, hs in (await self.store.put(tensors)).items()})
        done: m.DoneMsg = {
            "worker_id": self.worker_id,
            "task_id": task["task_id"],
            "fields": fields,
            "lengths": out.lengths,
            "version": out.version,
            "metrics": out.metrics,
        }
        if out.weights is not None:
            done["weights"] = await publish_weights(self.store, out.weights)
        elif out.published is not None:
            done["weights"] = out.published
        if out.failed:
            done["failed"] = out.failed
        return done

    async def _heartbeats(self) -> None:
        cfg = self.config
        while not self._stopped.is_set():
            try:
                reply = await self._relay_rpc.call(
                    m.OP_HEARTBEAT,
                    {**self._me, "version": self.version,
                     "busy": self._in_flight},
                    timeout=cfg.rpc_timeout_s,
                )
                ok = reply.get("ok") if isinstance(reply, dict) else None
                if ok is False:
                    self._log().warning("controller no longer knows this worker; exiting",
                                worker=self.worker_id)
                    self._stopped.set()
                    return
                if ok is not True:
                    self._log().warning("malformed heartbeat reply", reply=repr(reply)[:200])
            except DeadlineExceeded:
                self._log().warning("heartbeat unanswered", worker=self.worker_id)
            except ClosedError:
                raise
            except TransportError as exc:  # an error reply: the next heartbeat may do better
                self._log().warning("heartbeat failed", error=repr(exc)[:200])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(cfg.heartbeat_s):
                    await self._stopped.wait()

    async def _broadcasts(self) -> None:
        while not self._stopped.is_set():
            topic, payload = await self._sub.recv()
            if topic == m.TOPIC_STOP:
                self._stopped.set()
                return
            if topic == m.TOPIC_NODE_LOST:
                node = payload.get("node") if isinstance(payload, dict) else None
                if type(node) is str:  # its reads fail now, not after their timeout
                    await self.store.lose_node(node)
                continue
            if topic != m.TOPIC_VERSION:
                continue
            version = payload.get("version") if isinstance(payload, dict) else None
            weights = payload.get("weights") if isinstance(payload, dict) else None
            if type(version) is not int or not isinstance(weights, dict):
                self._log().warning("dropped a malformed version broadcast",
                                    payload=repr(payload)[:200])
                continue
            try:
                await self._switch_version(version, weights)
            except (ClosedError, WeightSyncError):
                raise
            except Exception as exc:  # keep serving the current version (heartbeats say which)
                self._log().error("could not load a new version", new_version=version,
                                  error=repr(exc)[:200])

    async def _switch_version(self, version: int, weights: Mapping[str, Any]) -> None:
        """Load ``version`` at a safe point: no task in flight (unless the role is
        interruptible), none starting meanwhile."""
        if version <= self.version:
            return
        if not getattr(self.role, "loads_weights", True):
            self.version = version  # what its heartbeats and logs show; nothing to load
            return
        self._gate.clear()
        try:
            if not getattr(self.role, "interruptible", False):
                await self._idle.wait()
            running, continued = self._in_flight, None
            deadline = self.config.weight_sync_timeout_s
            try:
                async with asyncio.timeout(deadline):
                    state = await self.weights.fetch(version, weights)
                    continued = await self.role.load_version(version, state)
            except TimeoutError:
                error = (f"worker {self.worker_id} ({self.config.name}) did not load policy "
                         f"version {version} within {deadline:g}s (serving {self.version})")
                self._log().error("weight sync deadline missed", new_version=version,
                                  deadline_s=deadline)
                with contextlib.suppress(TransportError):
                    await self._rpc.call(m.OP_SYNC_FAILED, {
                        **self._me, "version": version, "error": error},
                        timeout=min(5.0, self.config.rpc_timeout_s))
                raise WeightSyncError(error) from None
            self.version = version
            served: dict[str, Any] = {**self._me, "version": version}
            if running:
                served.update(interrupted=running, continued=continued or 0)
                self._log().info("running tasks continue under the new version",
                                 new_version=version, tasks=running, sequences=continued or 0)
            if self._served is None:
                await self._rpc.call(m.OP_SERVED, served)
            else:
                await self._served.report(served)
        finally:
            self._gate.set()


class _Stop(Exception):
    """Internal: unwinds the worker's task group on stop."""


def _is_register_reply(reply: Any) -> bool:
    return (isinstance(reply, dict) and type(reply.get("worker_id")) is str
            and type(reply.get("version")) is int and reply["version"] >= 0
            and (reply.get("token") is None or type(reply["token"]) is bytes)
            and (reply.get("weights") is None or isinstance(reply["weights"], dict)))


def _is_task(task: Any) -> bool:
    """Whether a decoded message has the shape of `m.TaskMsg` (the values are checked where
    they are used: a bad handle fails the task, which is then reported failed)."""
    if not (isinstance(task, dict) and type(task.get("task_id")) is int
            and type(task.get("stage")) is str and isinstance(task.get("params"), dict)):
        return False
    for key in ("rows", "groups", "row_groups"):
        ids = task.get(key)
        if type(ids) is not list or any(type(i) is not int for i in ids):
            return False
    inputs = task.get("inputs")
    return isinstance(inputs, dict) and all(
        type(k) is str and type(v) is list for k, v in inputs.items())
