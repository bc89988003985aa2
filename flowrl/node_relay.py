"""A node agent's relay: the controller's broadcasts fanned out to the node's workers, and the
workers' ``served`` reports gathered into one message per node.

Without it a new policy version costs the controller three messages per rollout worker: the
broadcast (the publisher sends one copy per subscriber), the worker's ``served`` request once it
has loaded the weights, and the reply; and each worker's heartbeat is a request and a reply a
second. With it the controller sends one copy per node agent and takes one ``node_served``
request per node and batch, and one ``node_heartbeat`` per node every `HEARTBEAT_S`. The
agent (`flowrl.node`, either kind) runs a `NodeRelay`:

- *broadcasts*: it subscribes to the controller's topics (``version``, ``stop``,
  ``node_lost``) and republishes each message on an ipc publisher of its own, which its
  node's workers join instead of the controller's. A worker that stops reading the relay is
  dropped by it (as the controller's publisher would) and reported upstream in the next
  ``node_served``, where the controller treats it as hung, as before.
- *heartbeats*: workers send their heartbeats to the relay too; every `HEARTBEAT_S` (or the
  workers' heartbeat period when shorter: `flowrl.node_hub.relay_heartbeat_s`) it passes
  on the workers it heard from since the last time in one ``node_heartbeat``, each worker at
  most once every ``renew_s`` (a fifth of the controller's heartbeat timeout:
  `flowrl.node_hub.relay_renew_s`), and answers a worker the controller no longer knows
  ``ok: False`` (it exits, as before). A worker that stops (dies, hangs) is no longer passed
  on, so its deadline at the controller runs out, no later than if each of its heartbeats had
  been passed on.
- *served*: workers send their ``served`` reports (the request they would send the
  controller, with their id and token) to the relay's ipc endpoint, the reports of one
  process's workers made in one turn of its event loop in one ``served_many``
  (`workers.runtime.ServedReports`); the relay answers at once and keeps each worker's latest
  report. One ``node_served``
  is in flight at a time; what arrives meanwhile goes in the next, so the first report of a
  version travels at once and the rest of the node's follow in one or a few messages.

Gathered entries travel as arrays, not maps: ``[worker id, token, version]`` (then
``interrupted, continued`` when the worker said them) in ``node_served``, ``[worker id,
token]`` in ``node_heartbeat``. Each rollout worker reports each version and every worker
heartbeats, so at a thousand workers these are the controller's most numerous entries; an
array decodes and reads in about half the time of a map with its keys.

The controller checks each gathered entry as it checked the worker's own request (the worker's
token, that the worker is registered on that node), and the whole request carries the node's
token (`flowrl.node_hub.NODE_TOKEN_ENV` for the agent beside the controller, the ``node_join``
reply for the others), so only the node's agent can report drops. An entry of a worker the
controller has already forgotten (it died before its agent reported) is ignored: a dead worker
is never counted as serving, nor kept alive. An agent that dies ends the run
(`flowrl.control.workforce`), so nothing it gathered outlives it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Final

import structlog

from flowrl import messages as m
from transport.curve import CurveKeys
from transport.endpoints import ipc_endpoint
from transport.errors import DeadlineExceeded, TransportError
from transport.pubsub import DroppedSubscriber, Publisher, Subscriber
from transport.rpc import RpcServer

__all__ = ["HEARTBEAT_S", "Beat", "NodeRelay", "Renewals"]

log = structlog.get_logger("flowrl.node")

#: how often the relay passes its workers' heartbeats on (well within any heartbeat timeout).
HEARTBEAT_S: Final = 0.5
# The most drops kept waiting: one per subscriber at most, bounded as a backstop.
_MAX_DROPS: Final = 1024

Send = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""Sends one request (``node_served``, ``node_heartbeat``) and its payload to the controller;
None back means the controller is gone."""


Beat = tuple[str, bytes]
"""A worker's heartbeat as a relay keeps it: (worker id, token)."""


class Renewals:
    """Which of the heartbeats heard are passed on: each at most once every ``renew_s`` (0:
    every one), counted from when the controller took it (`sent`), so a pass that failed
    delays none. Pure: the caller says the time.

    Keyed by (worker id, token), so a process that sends another's id with a wrong token
    cannot hold the right one back. A worker that stops is not heard from, so its deadline at
    the controller runs out no later than if each of its heartbeats were passed on."""

    def __init__(self, renew_s: float) -> None:
        self.renew_s = renew_s
        self._passed: dict[Beat, float] = {}  # when each was last passed on

    def __len__(self) -> int:
        """How many heartbeats it remembers passing on (bounded by the workers it hears)."""
        return len(self._passed)

    def due(self, heard: Collection[Beat], now: float) -> list[Beat]:
        """The heartbeats of ``heard`` to pass on at ``now``."""
        if not self.renew_s:
            return list(heard)
        passed, renew_s = self._passed, self.renew_s
        return [b for b in heard if now - passed.get(b, -math.inf) >= renew_s]

    def sent(self, beats: Collection[Beat], now: float) -> None:
        """The controller took ``beats`` at ``now``."""
        if not self.renew_s:
            return
        passed = self._passed
        passed.update(zip(beats, itertools.repeat(now)))
        if len(passed) > 2 * len(beats) + 64:  # workers gone: keep only what holds one back
            self._passed = {b: t for b, t in passed.items() if now - t < self.renew_s}


class NodeRelay:
    """The relay of node ``node``: start it, hand its endpoints (`broadcast`, `served`) to the
    node's workers, and run `run` until the agent stops."""

    def __init__(self, run_id: str, node: str, upstream: str, token: bytes, send: Send, *,
                 curve: CurveKeys | None = None, heartbeat_s: float = HEARTBEAT_S,
                 renew_s: float = 0.0) -> None:
        """``upstream``: the controller's broadcast endpoint; ``token``: this node's token;
        ``send``: how a request reaches the controller; ``heartbeat_s``: how often the
        workers' heartbeats are passed on; ``renew_s``: how often one worker's is (0: every
        one heard; `flowrl.node_hub.relay_renew_s`)."""
        self.node = node
        self._token = token
        self._send = send
        self._sub = Subscriber(upstream, list(m.WORKER_TOPICS), name=f"node:{node}",
                               curve=curve)
        self._pub = Publisher(ipc_endpoint(run_id, f"relay-{node}"), on_drop=self._dropped)
        self._server = RpcServer(ipc_endpoint(run_id, f"served-{node}"),
                                 {m.OP_SERVED_MANY: self._served_many,
                                  m.OP_HEARTBEAT: self._heartbeat},
                                 tensors=False)
        self._heartbeat_s = heartbeat_s
        self._renewals = Renewals(renew_s)
        # Heartbeats heard since the last were passed on, as (worker id, token): a process
        # that sends another's id with a wrong token cannot replace the right one.
        self._beats: set[Beat] = set()
        # Workers the controller no longer knows: their next heartbeat is answered ok False.
        self._forgotten: set[str] = set()
        # Each worker's latest report, by worker id, and the drops: sent with the next request.
        self._pending: dict[str, list[Any]] = {}
        self._drops: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self.broadcast = ""
        self.served = ""
        #: ``node_served`` requests sent (tests and benchmarks read it)
        self.sent = 0
        #: told each well-formed ``served`` report as it comes (worker id, token, version):
        #: the node's local dispatch learns its workers' versions before the controller does
        self.on_served: Callable[[str, bytes, int], None] | None = None

    async def start(self, timeout: float) -> None:  # noqa: ASYNC109 (Subscriber.join's)
        """Join the controller's broadcasts first, then listen: a worker that joins the relay
        sees every broadcast the controller sends after it registered."""
        await self._sub.join(timeout=timeout)
        self.broadcast = await self._pub.start()
        self.served = await self._server.start()

    async def run(self, on_stop: Callable[[], None]) -> None:
        """Relay until cancelled; ``on_stop()`` once the controller broadcast ``stop`` (after
        passing it on)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._report())
            tg.create_task(self._pass_heartbeats())
            await self._forward(on_stop)

    async def aclose(self) -> None:
        await self._server.aclose()
        await self._pub.aclose()
        await self._sub.aclose()

    async def _forward(self, on_stop: Callable[[], None]) -> None:
        while True:
            topic, payload = await self._sub.recv()
            await self._pub.publish(topic, payload)
            if topic == m.TOPIC_STOP:
                on_stop()

    async def _served_many(self, p: Any, peer: bytes) -> dict[str, Any]:
        """The ``served`` reports of one process's workers: checked for shape here, for their
        tokens by the controller. One malformed report refuses the request, taking none."""
        reports = p.get("reports") if isinstance(p, dict) else None
        if type(reports) is not list or not 0 < len(reports) <= m.MAX_NODE_SERVED:
            raise ValueError(f"served_many needs 'reports', a list of 1 to "
                             f"{m.MAX_NODE_SERVED} served reports")
        for i, r in enumerate(reports):
            if not (isinstance(r, dict) and type(r.get("worker_id")) is str
                    and type(r.get("token")) is bytes and type(r.get("version")) is int):
                raise ValueError(f"report {i}: served needs 'worker_id', 'token' and 'version'")
        pending = self._pending
        new = {r["worker_id"] for r in reports} - pending.keys()
        if len(pending) + len(new) > m.MAX_NODE_SERVED:
            raise ValueError("too many served reports waiting")  # only a flood gets here
        on_served = self.on_served
        for r in reports:
            entry: list[Any] = [r["worker_id"], r["token"], r["version"]]
            if "interrupted" in r or "continued" in r:
                entry += [r.get("interrupted", 0), r.get("continued", 0)]
            pending[r["worker_id"]] = entry
            if on_served is not None:
                on_served(r["worker_id"], r["token"], r["version"])
        self._wake.set()
        return {"ok": True}

    async def _heartbeat(self, p: Any, peer: bytes) -> dict[str, Any]:
        """A worker's heartbeat: passed on with the others within `heartbeat_s`."""
        if not (isinstance(p, dict) and type(p.get("worker_id")) is str
                and type(p.get("token")) is bytes):
            raise ValueError("heartbeat needs 'worker_id' and 'token'")
        if p["worker_id"] in self._forgotten:
            return {"ok": False}
        beat = (p["worker_id"], p["token"])
        if beat not in self._beats and len(self._beats) >= m.MAX_NODE_SERVED:
            raise ValueError("too many heartbeats waiting")  # only a flood gets here
        self._beats.add(beat)
        return {"ok": True}

    async def _pass_heartbeats(self) -> None:
        """Every `heartbeat_s`, the workers heard from since the last time, in one request.
        A timer, not an event: the sign of a dead worker is an absence of heartbeats, so a
        worker not heard from is not passed on and its deadline at the controller runs out."""
        while True:
            await asyncio.sleep(self._heartbeat_s)
            heard, self._beats = self._beats, set()
            now = time.monotonic()
            beats = self._renewals.due(heard, now)
            for i in range(0, len(beats), m.MAX_NODE_SERVED):
                chunk = beats[i:i + m.MAX_NODE_SERVED]
                payload = {"node": self.node, "token": self._token,
                           "workers": [[w, t] for w, t in chunk]}
                try:
                    reply = await self._send(m.OP_NODE_HEARTBEAT, payload)
                except TransportError as exc:
                    log.warning("node_heartbeat refused", node=self.node, error=repr(exc)[:200])
                    continue
                if reply is None:
                    return  # the controller is gone; the agent exits
                self._renewals.sent(chunk, now)
                unknown = reply.get("unknown") if isinstance(reply, dict) else None
                sent = {w for w, _ in chunk}
                # Only ids this relay passed on: the set stays bounded by the node's workers.
                self._forgotten.update(w for w in unknown or () if w in sent)

    def _dropped(self, dropped: DroppedSubscriber) -> None:
        if len(self._drops) < _MAX_DROPS:
            self._drops.append({"name": dropped.name, "reason": dropped.reason,
                                "connected": dropped.connected})
            self._wake.set()

    async def _report(self) -> None:
        """One ``node_served`` in flight at a time, carrying all that waits."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending or self._drops:
                entries = list(self._pending.values())[:m.MAX_NODE_SERVED]
                for e in entries:
                    del self._pending[e[0]]
                drops, self._drops = self._drops, []
                payload: dict[str, Any] = {"node": self.node, "token": self._token,
                                           "served": entries, "dropped": drops}
                try:
                    reply = await self._send(m.OP_NODE_SERVED, payload)
                except DeadlineExceeded:
                    # Unanswered (taking a report twice is harmless): sent again with the next,
                    # unless a worker reported a later version meanwhile.
                    for e in entries:
                        self._pending.setdefault(e[0], e)
                    self._drops[:0] = drops
                    continue
                except TransportError as exc:  # refused: logged, as a worker's own would be
                    log.warning("node_served refused", node=self.node, error=repr(exc)[:200])
                    continue
                self.sent += 1
                if reply is None:
                    return  # the controller is gone; the agent exits

    @property
    def waiting(self) -> int:
        """Reports not yet sent."""
        return len(self._pending)

