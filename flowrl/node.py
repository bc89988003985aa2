"""Node agents; the controller's side of the nodes that are not its own is `flowrl.node_hub`.

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
  With ``--broadcast`` (the controller's publisher) it relays the controller's broadcasts to
  the node's workers and gathers their heartbeats and ``served`` reports
  (`flowrl.node_relay`).

- on another node::

      python -m flowrl.node --controller tcp://HOST:PORT --node NAME [--keys FILE] [--host ADDR]

  It joins the run (``node_join`` gives the run id, the store capacity, the broadcast endpoint
  and the data plane), serves its store on ipc to its own workers and on ``tcp://ADDR``
  (curve) to other nodes (``node_ready``), then long-polls ``node_poll`` for worker processes
  to start or to kill and reports their exits (``node_exit``), and, once the processes of a
  kill order are gone, says so (``node_stopped``, after their exits). Its workers hear the
  controller's broadcasts through it and send it their heartbeats and ``served`` reports
  (`flowrl.node_relay`). Cross-node data never goes through the controller: workers read
  other nodes' handles from those nodes' store servers.

With the ``plaintext`` data plane (``ClusterSettings.data_plane``), every agent's tcp store
server also serves reads unencrypted, their requests authenticated with the run's keys
(`transport.store_server`); readers find that endpoint themselves.

An agent on another node that cannot use its keys says so in one line and exits with code 2:
a key file it cannot read (missing, unreadable, not 0600, not keys), no keys at all, or keys
the controller refuses (another run's: told within a second of reaching the controller, by its
failed curve handshakes, not after ``--orphan-s``).

Lifetime guarantees: an agent exits on SIGTERM, on SIGINT (unless a flowrl process started it:
that one stops it, `flowrl.lifecycle.stop_signals`), when the controller broadcasts ``stop``
or answers a poll with stop, when its parent dies (beside the controller, or started by a flowrl
process that sets ``FLOWRL_PARENT_PID``: Linux parent-death signal, armed before the heavy
imports, so also while it is starting), and — orphaned — when the controller has not answered
for ``--orphan-s`` seconds (it exits within ``orphan_s`` plus one call timeout). On exit it
stops its workers (polite, then TERM, then KILL) before it removes its segments, since workers
may still be reading them.
"""

from __future__ import annotations

import os

from flowrl.lifecycle import PARENT_ENV, die_with_parent, run_main, stop_signals

if __name__ == "__main__" and PARENT_ENV in os.environ:
    # Started by a flowrl process (the controller, a Ray agent's actor): armed first thing,
    # as the imports below take a while and a parent killed meanwhile must not leave
    # this process behind.
    die_with_parent()

import argparse
import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog

from flowrl.logs import bind, configure
from flowrl.node_dispatch import AgentLink
from flowrl.node_hub import (
    CALL_SLACK_S,
    NODE_PROTOCOL,
    NODE_TOKEN_ENV,
    OP_EXIT,
    OP_JOIN,
    OP_POLL,
    OP_READY,
    OP_STOPPED,
    POLL_S,
)
from flowrl.node_relay import HEARTBEAT_S, NodeRelay
from flowrl.worker_launch import worker_command
from flowrl.worker_spec import Endpoints, ProcessSpec, WorkerSpec
from transport.curve import ENV as KEYS_ENV
from transport.curve import CurveKeys, for_endpoint
from transport.endpoints import ipc_endpoint, tcp_endpoint
from transport.errors import (
    DeadlineExceeded,
    KeysRefused,
    RemoteError,
    SharedMemoryTooSmall,
    TransportError,
)
from transport.rpc import RpcClient
from transport.store import SampleStore
from transport.store_server import StoreServer

__all__ = ["main"]

log = structlog.get_logger("flowrl.node")

#: exit code of an agent that cannot use its keys, or that the controller refused (not this
#: run's node, another flowrl version): the operator's to fix, like a recipe error.
EXIT_KEYS = 2
_GET_KEYS = ("copy the key file the controller wrote for this run (placement.cluster.keys_file; "
             "the controller logs it as keys_file when it starts) to this node and pass it with "
             "--keys")


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
    p.add_argument("--broadcast", help="beside the controller: its broadcast endpoint, relayed "
                   "to this node's workers (`flowrl.node_relay`; token from $FLOWRL_NODE_TOKEN)")
    p.add_argument("--heartbeat-s", type=float, default=0.5,
                   help="beside the controller, with --broadcast: how often the relay passes "
                   "the workers' heartbeats on")
    p.add_argument("--renew-s", type=float, default=0.0,
                   help="beside the controller, with --broadcast: how often the relay passes "
                   "on one worker's heartbeat (0: each one)")
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


def agent_keys(path: Path | None, controller: str,
               environ: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The keys of an agent on another node: from the file `path`, else from
    ``$FLOWRL_CURVE_KEYS``; None only for a controller reached without curve (ipc).
    ValueError, in one line that says how to get the right keys, when there are none to use."""
    if path is not None:
        try:
            return CurveKeys.load(path)
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"cannot read the run's keys from {path}: {why}; "
                             f"{_GET_KEYS}") from None
    try:
        keys = CurveKeys.from_env(environ)
    except ValueError as exc:
        raise ValueError(f"${KEYS_ENV} holds no usable keys ({exc}); {_GET_KEYS}") from None
    if keys is None and not controller.startswith(("ipc://", "inproc://")):
        raise ValueError(f"no keys: the controller at {controller} admits only agents that "
                         f"hold its run's keys; {_GET_KEYS} (or set ${KEYS_ENV})")
    return keys


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in stop_signals():
        loop.add_signal_handler(sig, stop.set)


async def serve_beside(args: argparse.Namespace) -> None:
    """The agent the controller starts on its own node."""
    stop = asyncio.Event()
    _stop_on_signals(stop)
    keys = _keys(args)
    token = bytes.fromhex(os.environ.pop(NODE_TOKEN_ENV, ""))
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
            ctl = await stack.enter_async_context(RpcClient(args.controller))
            relay = None
            if args.broadcast:
                relay = NodeRelay(args.run_id, args.node, args.broadcast, token,
                                  ctl.call, heartbeat_s=args.heartbeat_s,
                                  renew_s=args.renew_s)
                stack.push_async_callback(relay.aclose)
                await relay.start(timeout=POLL_S + CALL_SLACK_S)
                up.update(broadcast=relay.broadcast, relay=relay.served)
            await ctl.call("node_up", up)
            log.info("node agent up", node=args.node, store=server.endpoint)
            async with asyncio.TaskGroup() as tg:
                # The controller stops this agent itself once its workers are gone (they
                # read this node's store): a stop broadcast is only passed on.
                relaying = tg.create_task(relay.run(lambda: None)) if relay else None
                await stop.wait()
                if relaying is not None:
                    relaying.cancel()
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
        #: node-local dispatch of its leased workers' tasks (None: all central)
        self.leases: AgentLink | None = None
        self.relay: NodeRelay | None = None

    def _on_exit(self, child: Any, code: int) -> None:
        # Killed on the controller's order or not, the controller forgets the process's workers.
        # Its last error (logged, or the traceback it printed) says why, on the controller too.
        self.reports.put_nowait((OP_EXIT, {"node": self.node, "name": child.name,
                                           "pid": child.pid, "code": code,
                                           "expected": bool(child.expected_exit),
                                           "error": child.last_error}))

    async def run(self) -> None:
        _stop_on_signals(self.stop)
        try:
            join = await self._call(OP_JOIN, {"node": self.node, "pid": os.getpid(),
                                              "protocol": NODE_PROTOCOL})
        except RemoteError as exc:  # not this run's node, joined already, another version
            raise JoinRefused(exc.message) from None
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
                relay = self.relay = NodeRelay(
                    self.run_id, self.node, self.broadcast, bytes(join.get("token", b"")),
                    self._send_up, curve=for_endpoint(self.keys, self.broadcast),
                    heartbeat_s=float(join.get("heartbeat_s", HEARTBEAT_S)),
                    renew_s=float(join.get("renew_s", 0.0)))
                stack.push_async_callback(relay.aclose)
                await relay.start(timeout=POLL_S + CALL_SLACK_S)
                if await self._call(OP_READY, {"node": self.node,
                                               "peer_store": peer.endpoint}) is None:
                    raise TransportError("the controller stopped answering")
                log.info("node agent up", node=self.node, store=peer.endpoint,
                         plaintext_reads=peer.plaintext_endpoint)
                self.leases = await AgentLink.join(  # before any spawn: workers need its endpoint
                    self.node, self._call, ipc_endpoint(self.run_id, f"tasks-{self.node}"))
                if self.leases is not None:
                    relay.on_served = self.leases.api.served
                try:
                    async with asyncio.TaskGroup() as tg:
                        tasks = [tg.create_task(self._poll()), tg.create_task(self._report()),
                                 tg.create_task(relay.run(self.stop.set))]
                        if self.leases is not None:
                            tasks.append(tg.create_task(self.leases.run()))
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
            except KeysRefused as exc:
                if not self.run_id:
                    raise  # the join: these keys are not the run's (`main` says so)
                # Joined with these keys: the endpoint now serves another run.
                log.warning("controller gone; exiting", node=self.node, error=str(exc))
                return None
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
            assert self.relay is not None  # started before the agent said it was ready
            where = Endpoints(run_id=self.run_id, node=self.node,
                              controller=self.args.controller, broadcast=self.relay.broadcast,
                              relay=self.relay.served, store=self.local_store,
                              peers=command.get("peers", {}),
                              tasks=None if self.leases is None
                              else self.leases.tasks_endpoint(process.role))
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

    async def _send_up(self, op: str, payload: dict[str, Any]) -> Any:
        """The relay's gathered reports, to the controller; None once it stopped answering."""
        reply = await self._call(op, payload)
        if reply is None:
            self.stop.set()
        return reply


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    configure()
    if args.run_id is not None:
        die_with_parent()
        bind(run_id=args.run_id, role="node", node=args.node)
        _run_agent(serve_beside(args))
        return
    bind(role="node", node=args.node)
    try:
        keys = agent_keys(args.keys, args.controller)
    except ValueError as exc:
        log.error(str(exc))
        raise SystemExit(EXIT_KEYS) from None

    async def agent() -> None:
        await _Agent(args, keys).run()

    try:
        _run_agent(agent())
    except JoinRefused as exc:
        log.error(f"the controller at {args.controller} refused this agent: {exc}")
        raise SystemExit(EXIT_KEYS) from None
    except KeysRefused as exc:
        held = f"the keys in {args.keys}" if args.keys is not None else f"${KEYS_ENV}"
        log.error(f"the controller at {exc.endpoint} refused {held} ({exc.reason}): they are "
                  f"not this run's keys; {_GET_KEYS}")
        raise SystemExit(EXIT_KEYS) from None


class JoinRefused(Exception):
    """The controller answered the agent's ``node_join`` with a refusal (its message)."""


def _run_agent(main: Coroutine[Any, Any, None]) -> None:
    try:
        run_main(main)
    except SharedMemoryTooSmall as exc:  # the operator's to fix: one line, not a traceback
        log.error("node agent cannot start its store", error=str(exc))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
