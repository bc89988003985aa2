"""Node agents, and the controller's side of the nodes that are not its own.

One agent per node owns that node's shared-memory sample store (its capacity bound and segment
reference counts; segment names carry the agent's pid and start time, so two agents on one
machine never share a segment), serves reads from other nodes and frees from the controller,
and removes every segment it holds when it exits.

Two ways to run one:

- beside the controller (the controller starts it)::

      python -m flowrl.node --run-id R --node N --controller EP --store EP --capacity BYTES
                            [--peer-store tcp://HOST:0 [--data-plane plaintext]]

  It says ``node_up``; the controller starts that node's workers itself. With ``--peer-store``
  it also serves the store over tcp+curve (keys from ``FLOWRL_CURVE_KEYS``) to other nodes.

- on another node::

      python -m flowrl.node --controller tcp://HOST:PORT --node NAME [--keys FILE] [--host ADDR]

  It joins the run (``node_join`` gives the run id, the store capacity, the broadcast endpoint
  and the data plane), serves its store on ipc to its own workers and on ``tcp://ADDR``
  (curve) to other nodes (``node_ready``), then long-polls ``node_poll`` for worker processes
  to start or to kill and reports their exits (``node_exit``), and, once the processes of a
  kill order are gone, says so (``node_stopped``, after their exits). Cross-node data never
  goes through the controller: workers read other nodes' handles from those nodes' store
  servers.

With the ``plaintext`` data plane (``ClusterSettings.data_plane``), every agent's tcp store
server also serves reads unencrypted, their requests authenticated with the run's keys
(`transport.store_server`); readers find that endpoint themselves.

Lifetime guarantees: an agent exits on SIGTERM/SIGINT, when the controller broadcasts ``stop``
or answers a poll with stop, when its parent dies (beside the controller, or started by a flowrl
process that sets ``FLOWRL_PARENT_PID``: Linux parent-death signal, armed before the heavy
imports, so also while it is starting), and — orphaned — when the controller has not answered
for ``--orphan-s`` seconds (it exits within ``orphan_s`` plus one call timeout). On exit it
stops its workers (polite, then TERM, then KILL) before it removes its segments, since workers
may still be reading them.

Controller side: `NodeHub` (the tcp+curve endpoint, the registry of remote agents, their spawn
queues, loss detection), `FanOutPublisher` (broadcasts to local and remote subscribers) and
`StoreRouter` (frees go to the node that holds the handles).
"""

from __future__ import annotations

import os

from flowrl.lifecycle import PARENT_ENV, die_with_parent, run_main

if __name__ == "__main__" and PARENT_ENV in os.environ:
    # Started by a flowrl process (the controller, a Ray agent's actor): armed first thing,
    # as the imports below take seconds (torch) and a parent killed meanwhile must not leave
    # this process behind.
    die_with_parent()

import argparse
import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
from pydantic import ConfigDict, Field

from flowrl import messages as m
from flowrl.logs import bind, configure
from flowrl.recipe import ClusterSettings
from flowrl.worker_launch import worker_command
from flowrl.worker_spec import Endpoints, ProcessSpec, WorkerSpec
from transport.curve import CurveKeys, for_endpoint
from transport.endpoints import ipc_endpoint, tcp_endpoint
from transport.errors import (
    DeadlineExceeded,
    MalformedMessage,
    SharedMemoryTooSmall,
    TransportError,
)
from transport.handles import Handle
from transport.pubsub import DroppedSubscriber, Publisher, Subscriber
from transport.rpc import Handler, RpcClient, RpcServer
from transport.store import SampleStore
from transport.store_server import StoreServer

__all__ = ["ClusterConfig", "FanOutPublisher", "NodeHub", "StoreRouter", "main"]

log = structlog.get_logger("flowrl.node")

OP_JOIN: Final = "node_join"
OP_READY: Final = "node_ready"
OP_POLL: Final = "node_poll"
OP_EXIT: Final = "node_exit"
OP_STOPPED: Final = "node_stopped"

#: how long one ``node_poll`` waits for a command before answering "nothing".
POLL_S: Final = 2.0
#: slack on a call beyond its own wait, before the controller counts as unresponsive.
CALL_SLACK_S: Final = 3.0
# A stopping controller answers waiting polls with "stop" before closing; this bounds the wait.
_ANSWER_POLLS_S: Final = 2.0
# Beyond a poll's round trip: how long an agent may take to kill processes (SIGKILL, reaped).
_KILL_S: Final = 10.0



# =================================================================================================
# The agent


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flowrl.node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--controller", required=True, help="the controller's endpoint")
    p.add_argument("--node", required=True, help="this node's name")
    p.add_argument("--keys", type=Path, help="the run's curve keys (a 0600 file); default: "
                   "$FLOWRL_CURVE_KEYS")
    p.add_argument("--host", default="127.0.0.1",
                   help="address this node's store binds and other nodes reach it at")
    p.add_argument("--orphan-s", type=float, default=30.0,
                   help="exit when the controller has not answered for this long")
    p.add_argument("--run-id", help="beside the controller: the run (else asked from it)")
    p.add_argument("--store", help="beside the controller: the endpoint the store binds")
    p.add_argument("--capacity", type=int, help="beside the controller: store bytes")
    p.add_argument("--peer-store", help="beside the controller: also serve the store here "
                   "(tcp, curve) to other nodes")
    p.add_argument("--data-plane", choices=["encrypted", "plaintext"],
                   help="with --peer-store: how other nodes' reads travel (default encrypted; "
                   "an agent on another node gets this from the controller)")
    args = p.parse_args(argv)
    beside = [args.run_id, args.store, args.capacity]
    if any(v is not None for v in beside) and not all(v is not None for v in beside):
        p.error("--run-id, --store and --capacity go together")
    if args.data_plane is not None and args.peer_store is None:
        p.error("--data-plane goes with --peer-store")
    return args


def _keys(args: argparse.Namespace) -> CurveKeys | None:
    return CurveKeys.load(args.keys) if args.keys is not None else CurveKeys.from_env()


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def serve_beside(args: argparse.Namespace) -> None:
    """The agent the controller starts on its own node."""
    stop = asyncio.Event()
    _stop_on_signals(stop)
    keys = _keys(args)
    store = SampleStore(args.run_id, args.node, capacity_bytes=args.capacity)
    try:
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(StoreServer(store, args.store))
            up: dict[str, Any] = {"node": args.node, "store": server.endpoint}
            if args.peer_store:
                peer = await stack.enter_async_context(
                    _peer_server(store, args.peer_store, keys,
                                 plaintext=args.data_plane == "plaintext"))
                up["peer_store"] = peer.endpoint
            async with RpcClient(args.controller) as ctl:
                await ctl.call("node_up", up)
            log.info("node agent up", node=args.node, store=server.endpoint)
            await stop.wait()
    finally:
        store.close()


def _peer_server(store: SampleStore, endpoint: str, keys: CurveKeys | None, *,
                 plaintext: bool) -> StoreServer:
    curve = for_endpoint(keys, endpoint)
    # Without keys (loopback only) the store is plain already, and there is nothing to sign with.
    return StoreServer(store, endpoint, curve=curve, allow_remote=curve is not None,
                       plaintext=plaintext and curve is not None)


class _Agent:
    """An agent on a node of its own: joins the run and starts workers when asked."""

    def __init__(self, args: argparse.Namespace, keys: CurveKeys | None) -> None:
        from flowrl.procs import Supervisor

        self.args = args
        self.node: str = args.node
        self.keys = keys
        self.ctl = RpcClient(args.controller, timeout=POLL_S + CALL_SLACK_S,
                             curve=for_endpoint(keys, args.controller))
        self.stop = asyncio.Event()
        self.supervisor = Supervisor(self._on_exit)
        # Reports (an op and its payload): one exit per worker process started, one
        # acknowledgement per kill order, so bounded by the controller's commands.
        self.reports: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.last_answer = time.monotonic()
        self.run_id = ""
        self.broadcast = ""
        self.local_store = ""

    def _on_exit(self, child: Any, code: int) -> None:
        # Killed on the controller's order or not, the controller forgets the process's workers.
        self.reports.put_nowait((OP_EXIT, {"node": self.node, "name": child.name,
                                           "pid": child.pid, "code": code,
                                           "expected": bool(child.expected_exit)}))

    async def run(self) -> None:
        _stop_on_signals(self.stop)
        join = await self._call(OP_JOIN, {"node": self.node, "pid": os.getpid()})
        if join is None:
            if self.stop.is_set():
                return  # stopped before the controller ever answered
            raise TransportError(f"no controller answered at {self.args.controller}")
        self.run_id = str(join["run_id"])
        self.broadcast = str(join["broadcast"])
        bind(run_id=self.run_id)
        store = SampleStore(self.run_id, self.node, capacity_bytes=int(join["capacity"]))
        try:
            async with contextlib.AsyncExitStack() as stack:
                local = await stack.enter_async_context(
                    StoreServer(store, ipc_endpoint(self.run_id, f"store-{self.node}")))
                self.local_store = local.endpoint
                peer = await stack.enter_async_context(_peer_server(
                    store, tcp_endpoint(self.args.host), self.keys,
                    plaintext=join.get("data_plane") == "plaintext"))
                sub = Subscriber(self.broadcast, [m.TOPIC_STOP], name=f"node:{self.node}",
                                 curve=for_endpoint(self.keys, self.broadcast))
                stack.push_async_callback(sub.aclose)
                await sub.join(timeout=POLL_S + CALL_SLACK_S)
                if await self._call(OP_READY, {"node": self.node,
                                               "peer_store": peer.endpoint}) is None:
                    raise TransportError("the controller stopped answering")
                log.info("node agent up", node=self.node, store=peer.endpoint,
                         plaintext_reads=peer.plaintext_endpoint)
                try:
                    async with asyncio.TaskGroup() as tg:
                        tasks = [tg.create_task(self._poll()), tg.create_task(self._report()),
                                 tg.create_task(self._listen(sub))]
                        await self.stop.wait()
                        for t in tasks:
                            t.cancel()
                finally:
                    # Workers leave on the stop broadcast; stragglers are terminated. Only
                    # then does the store go: they may be reading its segments.
                    await self.supervisor.stop_all(grace_s=5.0)
        finally:
            store.close()
            await self.ctl.aclose()

    async def _call(self, op: str, payload: dict[str, Any],
                    wait_s: float = 0.0) -> Any:
        """`op` at the controller; None once it has not answered for `orphan_s` seconds."""
        while True:
            try:
                reply = await self.ctl.call(op, payload, timeout=wait_s + CALL_SLACK_S)
            except DeadlineExceeded as exc:  # any other error is a refusal: raised as is
                if self.stop.is_set():  # SIGTERM while the controller does not answer
                    return None
                if time.monotonic() - self.last_answer > self.args.orphan_s:
                    log.warning("controller gone; exiting", node=self.node, error=repr(exc))
                    return None
                continue
            self.last_answer = time.monotonic()
            return reply

    async def _poll(self) -> None:
        while True:
            reply = await self._call(OP_POLL, {"node": self.node, "wait_s": POLL_S}, POLL_S)
            if reply is None or reply.get("stop"):
                self.stop.set()
                return
            for order in reply.get("kill", ()):  # before spawns: a restart reuses the names
                await self._kill(order)
            for spec in reply.get("spawn", ()):
                await self._spawn(spec)

    async def _kill(self, order: Any) -> None:
        """Kill this node's worker processes that ``order`` names (SIGKILL: a broken rank group
        cannot leave politely), then acknowledge, after their exits."""
        names = order.get("names") if isinstance(order, dict) else None
        if (not isinstance(names, list) or not isinstance(order.get("id"), int)
                or not all(isinstance(n, str) for n in names)):
            log.warning("ignored a malformed kill command", node=self.node)
            return
        wanted = set(names)
        await self.supervisor.stop_all(0.0, only=lambda c: c.name in wanted,
                                       signals=(signal.SIGKILL,))
        # Every killed child's exit is queued by now (its watcher reports before it ends).
        self.reports.put_nowait((OP_STOPPED, {"node": self.node, "id": order["id"]}))

    async def _spawn(self, command: Any) -> None:
        """Start the worker process of a spawn command (its `ProcessSpec` and the other nodes'
        store endpoints), as the controller starts its own node's (`worker_command`)."""
        try:
            if not isinstance(command, dict):
                raise ValueError(f"a spawn command is a mapping, got {type(command).__name__}")
            process = ProcessSpec.model_validate(command.get("process"))
            where = Endpoints(run_id=self.run_id, node=self.node,
                              controller=self.args.controller, broadcast=self.broadcast,
                              store=self.local_store, peers=command.get("peers", {}))
        except ValueError as exc:  # pydantic's ValidationError is one
            log.warning("ignored a malformed spawn command", node=self.node, error=str(exc))
            return
        env = self.keys.to_env() if self.keys is not None else {}
        await self.supervisor.spawn(
            process.name, worker_command(WorkerSpec(process=process, endpoints=where)), env=env)

    async def _report(self) -> None:
        while True:
            op, payload = await self.reports.get()
            if await self._call(op, payload) is None:
                self.stop.set()
                return

    async def _listen(self, sub: Subscriber) -> None:
        while True:
            topic, _ = await sub.recv()
            if topic == m.TOPIC_STOP:
                self.stop.set()
                return


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure()
    if args.run_id is not None:
        die_with_parent()
        bind(run_id=args.run_id, role="node", node=args.node)
        _run_agent(serve_beside(args))
        return
    bind(role="node", node=args.node)

    async def agent() -> None:
        await _Agent(args, _keys(args)).run()

    _run_agent(agent())


def _run_agent(main: Coroutine[Any, Any, None]) -> None:
    try:
        run_main(main)
    except SharedMemoryTooSmall as exc:  # the operator's to fix: one line, not a traceback
        log.error("node agent cannot start its store", error=str(exc))
        raise SystemExit(1) from None


# =================================================================================================
# The controller's side


class ClusterConfig(ClusterSettings):
    """How the controller meets node agents on other nodes (used only when the pipeline places
    pools on nodes other than the controller's): a recipe's `ClusterSettings` (`from_settings`)
    plus what a recipe does not say."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    keys: CurveKeys | None = None
    """The run's curve keys; None makes fresh ones."""
    node_timeout_s: float = Field(default=15.0, gt=0.0)
    """A remote agent not heard from for this long is lost, and the run fails."""

    @classmethod
    def from_settings(cls, settings: ClusterSettings, *, host: str | None = None
                      ) -> ClusterConfig:
        """``settings``, with ``host`` replacing the default address (not one they give)."""
        values = dict(settings)
        if host is not None and "host" not in settings.model_fields_set:
            values["host"] = host
        return cls(**values)


@dataclass
class _Remote:
    name: str
    pid: int = 0
    peer_store: str = ""
    last_seen: float = 0.0
    # Spawn commands not yet collected: one per worker process of the node, plus restarts.
    commands: list[dict[str, Any]] = field(default_factory=list)
    # Kill orders not yet collected ({"id", "names"}): one per `NodeHub.stop_workers` call.
    kills: list[dict[str, Any]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class FanOutPublisher(Publisher):
    """The controller's broadcasts, to local subscribers (ipc) and remote ones (tcp, curve);
    a subscriber either drops is reported to this publisher's `on_drop`."""

    def __init__(self, endpoint: str, remote: Publisher) -> None:
        super().__init__(endpoint)
        self.remote = remote
        remote.on_drop = self._remote_dropped

    def _remote_dropped(self, subscriber: DroppedSubscriber) -> None:
        if self.on_drop is not None:
            self.on_drop(subscriber)

    @property
    def dropped(self) -> tuple[DroppedSubscriber, ...]:
        return super().dropped + self.remote.dropped

    async def start(self) -> str:
        await self.remote.start()
        return await super().start()

    async def publish(self, topic: str, payload: Any = None) -> None:
        await super().publish(topic, payload)
        await self.remote.publish(topic, payload)

    async def aclose(self) -> None:
        await super().aclose()
        await self.remote.aclose()


class StoreRouter(RpcClient):
    """The controller's store client: frees go to the node holding each handle (its own node's
    store over ipc, others over tcp+curve); ``stats`` adds every node's under ``nodes``."""

    def __init__(self, endpoint: str, node: str, peers: Mapping[str, str],
                 keys: CurveKeys) -> None:
        super().__init__(endpoint)
        self._node = node
        self._peers = peers
        self._keys = keys
        self._clients: dict[str, RpcClient] = {}

    def _client(self, node: str) -> RpcClient:
        client = self._clients.get(node)
        if client is None:
            client = self._clients[node] = RpcClient(self._peers[node], curve=self._keys)
        return client

    async def call(self, op: str, payload: Any = None, *,
                   timeout: float | None = None) -> Any:  # noqa: ASYNC109 (RpcClient's)
        if op == "free":
            by_node: dict[str, list[Any]] = {}
            for h in payload["handles"]:
                try:
                    node = Handle.from_wire(h).node
                except MalformedMessage:  # the own store refuses it and says why
                    node = self._node
                by_node.setdefault(node, []).append(h)
            own = super().call  # zero-argument super() is unavailable in a comprehension
            calls: list[Awaitable[Any]] = [
                own(op, {"handles": hs}, timeout=timeout) if node == self._node
                else self._client(node).call(op, {"handles": hs}, timeout=timeout)
                for node, hs in by_node.items()]
            await asyncio.gather(*calls)
            return None
        if op == "stats":
            local = await super().call(op, payload, timeout=timeout)
            others = [n for n in self._peers if n != self._node]
            stats = await asyncio.gather(
                *(self._client(n).call(op, payload, timeout=timeout) for n in others))
            return {**local, "nodes": {self._node: local, **dict(zip(others, stats,
                                                                     strict=True))}}
        return await super().call(op, payload, timeout=timeout)

    async def aclose(self) -> None:
        await super().aclose()
        for client in self._clients.values():
            await client.aclose()


class NodeHub:
    """The controller's endpoint for node agents on other nodes.

    Binds tcp (curve) for the controller's requests and broadcasts, admits exactly the nodes
    the pipeline names (each joins once), hands each agent its spawn commands and kill orders
    (`stop_workers`), knows every node's store endpoint (`peers`), and reports an agent not
    heard from within ``node_timeout_s`` through `on_lost` and a worker exit through `on_exit`
    (node, process name, pid, exit code, whether the controller had it killed).
    """

    def __init__(
        self, run_id: str, nodes: set[str], config: ClusterConfig, *, capacity: int,
        on_lost: Callable[[str], None], on_exit: Callable[[str, str, int, int, bool], None],
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.keys = config.keys or CurveKeys.generate()
        self.capacity = capacity
        self._on_lost = on_lost
        self._on_exit = on_exit
        self._remote = {n: _Remote(n) for n in sorted(nodes)}
        self.peers: dict[str, str] = {}
        self._server: RpcServer | None = None
        self._pub: FanOutPublisher | None = None
        self._listening = asyncio.Event()
        self._ready = asyncio.Event()
        self._changed = asyncio.Event()
        self._stopping = False
        self._polls = 0
        self._polls_done = asyncio.Event()
        # Kill orders awaiting their agent's acknowledgement: id -> (node, done).
        self._orders: dict[int, tuple[str, asyncio.Future[None]]] = {}
        self._order_ids = 0
        self.endpoint = ""

    @property
    def nodes(self) -> list[str]:
        return list(self._remote)

    def publisher(self, local_endpoint: str) -> FanOutPublisher:
        """The controller's publisher: `local_endpoint` plus tcp (curve) for remote workers."""
        remote = Publisher(tcp_endpoint(self.config.host), curve=self.keys,
                           allow_remote=True)
        self._pub = FanOutPublisher(local_endpoint, remote)
        return self._pub

    def store_args(self) -> list[str]:
        """The controller node's agent's arguments that serve its store to other nodes."""
        return ["--peer-store", tcp_endpoint(self.config.host),
                "--data-plane", self.config.data_plane]

    async def start(self, handlers: Mapping[str, Handler]) -> str:
        """Bind the request endpoint (the controller's `handlers` and the agents' ops)."""
        if self.config.keys_file is not None:
            self.keys.save(self.config.keys_file)
        ops: dict[str, Handler] = {**handlers, OP_JOIN: self._join, OP_READY: self._ready_op,
                                   OP_POLL: self._poll, OP_EXIT: self._exit,
                                   OP_STOPPED: self._stopped}
        self._server = RpcServer(tcp_endpoint(self.config.host, self.config.port), ops,
                                 long_polls={OP_POLL, *(m.LONG_POLLS & ops.keys())},
                                 curve=self.keys, allow_remote=True)
        self.endpoint = await self._server.start()
        self._listening.set()
        return self.endpoint

    async def wait_listening(self) -> str:
        """The request endpoint agents connect to, once bound."""
        await self._listening.wait()
        return self.endpoint

    async def wait_ready(self) -> None:
        """Return once every remote node's agent is ready; RuntimeError after
        ``join_timeout_s`` naming the missing ones."""
        try:
            async with asyncio.timeout(self.config.join_timeout_s):
                await self._ready.wait()
        except TimeoutError:
            missing = [n for n, r in self._remote.items() if not r.peer_store]
            raise RuntimeError(f"node agents did not join within "
                               f"{self.config.join_timeout_s}s: missing {missing}") from None

    def add_peer(self, node: str, endpoint: str) -> None:
        self.peers[node] = endpoint

    def peers_for(self, node: str) -> dict[str, str]:
        """The store endpoints of every node but `node`."""
        return {n: ep for n, ep in self.peers.items() if n != node}

    def spawn(self, node: str, process: ProcessSpec) -> None:
        """Ask `node`'s agent to start worker process `process` (`flowrl.worker_launch`)."""
        remote = self._remote[node]
        remote.commands.append({"process": process.model_dump(mode="json"),
                                "peers": self.peers_for(node)})
        remote.wake.set()

    async def stop_workers(self, node: str, names: Sequence[str]) -> None:
        """Have `node`'s agent kill its worker processes named `names` (SIGKILL); return once
        it says they are gone, their exits reported through `on_exit` before. TimeoutError
        when the agent has not acknowledged within ``node_timeout_s`` plus a margin."""
        remote = self._remote[node]
        self._order_ids += 1
        order = self._order_ids
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._orders[order] = (node, done)
        remote.kills.append({"id": order, "names": list(names)})
        remote.wake.set()
        try:
            async with asyncio.timeout(self.config.node_timeout_s + _KILL_S):
                await done
        finally:
            self._orders.pop(order, None)

    # -- ops ------------------------------------------------------------------------------------

    def _node(self, payload: Any) -> _Remote:
        name = payload.get("node") if isinstance(payload, dict) else None
        remote = self._remote.get(name) if isinstance(name, str) else None
        if remote is None:
            raise ValueError(f"node {name!r} is not part of this run; have {self.nodes}")
        return remote

    async def _join(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        if remote.pid:
            raise ValueError(f"node {remote.name!r} has already joined")
        remote.pid = int(payload.get("pid", 0)) or -1
        remote.last_seen = time.monotonic()
        assert self._pub is not None
        return {"run_id": self.run_id, "capacity": self.capacity,
                "broadcast": self._pub.remote.endpoint, "data_plane": self.config.data_plane}

    async def _ready_op(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        remote.peer_store = str(payload["peer_store"])
        remote.last_seen = time.monotonic()
        self.add_peer(remote.name, remote.peer_store)
        if all(r.peer_store for r in self._remote.values()):
            self._ready.set()
        log.info("node joined", node=remote.name, store=remote.peer_store)
        return {"ok": True}

    async def _poll(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        remote.last_seen = time.monotonic()
        self._changed.set()
        self._polls += 1
        self._polls_done.clear()
        try:
            if not remote.commands and not remote.kills and not self._stopping:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(float(payload.get("wait_s", POLL_S)), 30.0)):
                        await remote.wake.wait()
            remote.wake.clear()
            commands, remote.commands = remote.commands, []
            kills, remote.kills = remote.kills, []
            return {"spawn": commands, "kill": kills, "stop": self._stopping}
        finally:
            remote.last_seen = time.monotonic()
            self._polls -= 1
            if not self._polls:
                self._polls_done.set()

    async def _exit(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        remote.last_seen = time.monotonic()
        self._on_exit(remote.name, str(payload["name"]), int(payload["pid"]),
                      int(payload["code"]), bool(payload.get("expected", False)))
        return {"ok": True}

    async def _stopped(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        remote.last_seen = time.monotonic()
        node, done = self._orders.get(int(payload["id"]), ("", None))
        # Only the node the order went to may acknowledge it; a repeat is harmless.
        if done is not None and node == remote.name and not done.done():
            done.set_result(None)
        return {"ok": True}

    # -- lifetime -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch the agents until cancelled; then tell them to stop and close the endpoint."""
        try:
            await self._watch()
        finally:
            await self._close()

    async def _watch(self) -> None:
        timeout = self.config.node_timeout_s
        while True:
            joined = [r for r in self._remote.values() if r.pid]
            if not joined:
                self._changed.clear()
                await self._changed.wait()
                continue
            now = time.monotonic()
            lost = [r for r in joined if now - r.last_seen > timeout]
            for r in lost:
                log.warning("node agent lost", node=r.name, silent_s=round(now - r.last_seen, 1))
                r.last_seen = float("inf")  # reported once
                self._on_lost(r.name)
            oldest = min(r.last_seen for r in joined)
            # A timer to the next deadline (an event-driven wait has nothing to wait on: the
            # sign of loss is the absence of messages).
            await asyncio.sleep(max(0.05, oldest + timeout - now) if oldest != float("inf")
                                else timeout)

    async def _close(self) -> None:
        self._stopping = True
        for r in self._remote.values():
            r.wake.set()
        if self._polls:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_ANSWER_POLLS_S):
                    await self._polls_done.wait()
        if self._server is not None:
            await self._server.aclose()


if __name__ == "__main__":
    main()
