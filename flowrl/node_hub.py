"""The controller's side of the nodes that are not its own, and the protocol node agents
(`flowrl.node`) speak with it.

`NodeHub` (the tcp+curve endpoint, the registry of remote agents, their spawn queues, loss
detection), `FanOutPublisher` (broadcasts to local and remote subscribers) and `StoreRouter`
(frees go to the node that holds the handles); the ops agents call (``node_join``,
``node_ready``, ``node_poll``, ``node_exit``, ``node_stopped``) and their timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from pydantic import ConfigDict, Field

from flowrl import messages as m
from flowrl.recipe import ClusterSettings
from flowrl.worker_spec import ProcessSpec
from transport.curve import CurveKeys
from transport.endpoints import tcp_endpoint
from transport.errors import TransportError
from transport.handles import handle_nodes
from transport.key_file import HeldKeyFile, hold
from transport.pubsub import DroppedSubscriber, Publisher
from transport.rpc import Handler, RpcClient, RpcServer

__all__ = ["ClusterConfig", "FanOutPublisher", "NodeHub", "StoreRouter", "relay_heartbeat_s",
           "relay_renew_s"]

log = structlog.get_logger("flowrl.node")

OP_JOIN: Final = "node_join"
OP_READY: Final = "node_ready"
OP_POLL: Final = "node_poll"
OP_EXIT: Final = "node_exit"
OP_STOPPED: Final = "node_stopped"
#: what an agent and the controller say to each other, numbered: raised with every change of
#: it (2: gathered ``served`` and heartbeat entries as arrays). A joining agent says its
#: number, and one of another is refused with a message naming both.
NODE_PROTOCOL: Final = 2
#: the environment variable that hands the agent beside the controller its node token (hex);
#: the other agents get theirs in the ``node_join`` reply (`flowrl.node_relay`).
NODE_TOKEN_ENV: Final = "FLOWRL_NODE_TOKEN"

#: how long one ``node_poll`` waits for a command before answering "nothing".
POLL_S: Final = 2.0
#: slack on a call beyond its own wait, before the controller counts as unresponsive.
CALL_SLACK_S: Final = 3.0
# A stopping controller answers waiting polls with "stop" before closing; this bounds the wait.
_ANSWER_POLLS_S: Final = 2.0
# Beyond a poll's round trip: how long an agent may take to kill processes (SIGKILL, reaped).
_KILL_S: Final = 10.0
# After a refused agent is logged, further refusals within this long are only counted (an
# agent with wrong keys reconnects every 100 ms).
_REFUSALS_QUIET_S: Final = 60.0


def relay_heartbeat_s(worker_heartbeat_s: float) -> float:
    """How often a node agent passes its workers' heartbeats on: every half second, or as
    often as the workers beat when that is more often, so that a worker's deadline at the
    controller is renewed at most one heartbeat later than the worker sent it."""
    return min(0.5, worker_heartbeat_s)


def relay_renew_s(heartbeat_timeout_s: float) -> float:
    """How often a node agent passes on one worker's heartbeat: a fifth of the timeout after
    which the controller counts a silent worker dead. Enough to renew its deadline with room
    for four missed passes, and at 1,000 workers the controller takes a few hundred entries a
    second instead of one a worker and second (with the default 10 s timeout, 2 s)."""
    return heartbeat_timeout_s / 5


class ClusterConfig(ClusterSettings):
    """How the controller meets node agents on other nodes (used only when the pipeline places
    pools on nodes other than the controller's): a recipe's `ClusterSettings` (`from_settings`)
    plus what a recipe does not say."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    keys: CurveKeys | None = None
    """The run's curve keys; None makes fresh ones."""
    node_timeout_s: float = Field(default=15.0, gt=0.0)
    """A remote agent not heard from for this long is lost: its workers and its store's data
    with it. The run goes on without the node when it can (`flowrl.control.lost_nodes`)."""

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
    #: not heard from within ``node_timeout_s``: out of the run for good (`NodeHub.lose`)
    lost: bool = False
    #: what its agent signs its gathered reports with (`flowrl.node_relay`), given at its join
    token: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)
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
    store over ipc, others over tcp+curve; a lost node's are dropped); ``stats`` adds every
    node's under ``nodes``."""

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
            handles = payload["handles"]
            for h, named in zip(handles, handle_nodes(handles), strict=True):
                node = named or self._node  # undecodable: the own store refuses it, saying why
                if node != self._node and node not in self._peers:
                    continue  # a lost node's (`NodeHub.lose`): that memory is gone
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

    async def aclose(self, error: TransportError | None = None) -> None:
        await super().aclose(error)
        for client in self._clients.values():
            await client.aclose(error)


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
        heartbeat_s: float = 0.5, renew_s: float = 0.0, on_lost: Callable[[str], None],
        on_exit: Callable[[str, str, int, int, bool, str], None],
    ) -> None:
        self.run_id = run_id
        self.config = config
        self.keys = config.keys or CurveKeys.generate()
        self.capacity = capacity
        #: how often agents pass their workers' heartbeats on (`flowrl.node_relay`)
        self.heartbeat_s = heartbeat_s
        self.renew_s = renew_s
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
        self._key_file: HeldKeyFile | None = None
        self._refusals = 0  # refused handshakes since the last line that said so
        self._refusal_logged = -_REFUSALS_QUIET_S

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
        """Bind the request endpoint (the controller's `handlers` and the agents' ops); with
        ``keys_file``, write the run's keys there and hold the file until the hub closes
        (`transport.key_file`)."""
        if self.config.keys_file is not None:
            self._key_file = hold(self.keys, self.config.keys_file)
        ops: dict[str, Handler] = {**handlers, OP_JOIN: self._join, OP_READY: self._ready_op,
                                   OP_POLL: self._poll, OP_EXIT: self._exit,
                                   OP_STOPPED: self._stopped}
        self._server = RpcServer(tcp_endpoint(self.config.host, self.config.port), ops,
                                 long_polls={OP_POLL, *(m.LONG_POLLS & ops.keys())},
                                 curve=self.keys, allow_remote=True,
                                 on_refused=self._refused, tensors=False)
        try:
            self.endpoint = await self._server.start()
        except BaseException:
            self._release_key_file()
            raise
        self._listening.set()
        return self.endpoint

    def _refused(self, reason: str) -> None:
        """A client's handshake failed: its keys are not this run's. Said once, then counted
        (`_REFUSALS_QUIET_S`)."""
        self._refusals += 1
        now = time.monotonic()
        if now - self._refusal_logged < _REFUSALS_QUIET_S:
            return
        keys_file = self.config.keys_file
        log.warning("refused a connection: its curve keys are not this run's", reason=reason,
                    endpoint=self.endpoint, refused=self._refusals,
                    use=f"the key file {keys_file}" if keys_file is not None
                    else "the run's keys (FLOWRL_CURVE_KEYS)")
        self._refusals = 0
        self._refusal_logged = now

    def _release_key_file(self) -> None:
        if self._key_file is not None:
            self._key_file.release()
            self._key_file = None

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

    def token(self, node: str) -> bytes | None:
        """The token of `node`'s agent, once it joined (None before, or for no such node)."""
        remote = self._remote.get(node)
        return remote.token if remote is not None and remote.pid and not remote.lost else None

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
        if remote.lost:  # its agent was stopped, not dead, and woke up: it must go
            raise ValueError(f"node {remote.name!r} was declared lost after "
                             f"{self.config.node_timeout_s}s without a word and is out of the "
                             "run; its agent must exit")
        return remote

    async def _join(self, payload: Any, peer: bytes) -> dict[str, Any]:
        remote = self._node(payload)
        protocol = payload.get("protocol", 1)
        if protocol != NODE_PROTOCOL:
            error = (f"node {remote.name!r}'s agent speaks node protocol {protocol!r} and this "
                     f"controller {NODE_PROTOCOL}: run the same version of flowrl on every "
                     "node")
            log.error("node refused", node=remote.name, error=error)
            raise ValueError(error)
        if remote.pid:
            raise ValueError(f"node {remote.name!r} has already joined")
        remote.pid = int(payload.get("pid", 0)) or -1
        remote.last_seen = time.monotonic()
        assert self._pub is not None
        return {"run_id": self.run_id, "capacity": self.capacity,
                "broadcast": self._pub.remote.endpoint, "data_plane": self.config.data_plane,
                "token": remote.token, "heartbeat_s": self.heartbeat_s, "renew_s": self.renew_s}

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
                      int(payload["code"]), bool(payload.get("expected", False)),
                      str(payload.get("error") or "")[:500])
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
            joined = [r for r in self._remote.values() if r.pid and not r.lost]
            if not joined:
                self._changed.clear()
                await self._changed.wait()
                continue
            now = time.monotonic()
            lost = [r for r in joined if now - r.last_seen > timeout]
            for r in lost:
                log.warning("node agent lost", node=r.name, silent_s=round(now - r.last_seen, 1))
                self.lose(r.name)
                self._on_lost(r.name)
            alive = [r.last_seen for r in joined if not r.lost]
            if not alive:
                continue
            # A timer to the next deadline (an event-driven wait has nothing to wait on: the
            # sign of loss is the absence of messages).
            await asyncio.sleep(max(0.05, min(alive) + timeout - now))

    def lose(self, node: str) -> None:
        """``node`` is out of the run: its store is no peer any more, its requests are refused,
        and kill orders waiting for it are done (its workers die with their agent)."""
        remote = self._remote[node]
        remote.lost = True
        remote.commands.clear()
        remote.kills.clear()
        self.peers.pop(node, None)
        for order_node, done in self._orders.values():
            if order_node == node and not done.done():
                done.set_result(None)

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
        self._release_key_file()
