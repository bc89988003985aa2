"""Ray placement: the node agents of a run's other nodes, started as Ray actors.

`RayAgents` starts one actor per node the controller waits for (`NodeHub.nodes`, i.e. the nodes
``placement.roles`` names), each requesting what the recipe asks for that node (``num_cpus``,
``num_gpus``, custom resources such as ``{"NPU": 8}`` or a label that pins it to one machine);
Ray chooses the machine. The node's workers run inside that reservation: with ``num_gpus``,
the ``CUDA_VISIBLE_DEVICES`` Ray gives the actor reaches them.

Each actor runs the ordinary agent (the code of ``python -m flowrl.node --controller ...``) as
its child process, not as a coroutine inside the actor, because:

- it is the same program as an agent started by hand: one code path, tested both ways;
- the agent installs signal handlers, which only a main thread may do (an async actor's event
  loop runs in another thread);
- it forks worker processes and owns shared memory: in its own process it can be stopped
  politely (SIGTERM: it stops its workers, then removes its segments) whatever state the Ray
  worker process is in.

Guarantees:

- The run's curve keys reach an actor through its constructor (Ray's own channel, as trusted
  as the Ray cluster) and its agent through the environment (``FLOWRL_CURVE_KEYS``): never a
  command line, never a file.
- No agent outlives its actor, nor its workers the agent: Ray kills the processes of an actor
  that dies (Ray 2.60 does, with SIGKILL), and the agent asks for a parent-death signal in case
  Ray does not. An agent killed this way cannot remove its shared-memory segments:
  ``python -m flowrl.cleanup`` removes those of dead owners. The normal end is polite: the
  controller's stop broadcast, or `RayAgents.aclose`, lets agents stop their workers and remove
  their segments before any actor is killed. An agent whose controller vanished leaves on its
  own after ``orphan_s`` seconds.
- `RayAgents.aclose` stops every agent (most have left already on the controller's stop
  broadcast), kills every actor, and shuts Ray down when it was the one that started it.

Ray is optional (``pip install 'flowrl[ray]'``) and imported only here, only when used.
"""

from __future__ import annotations

import asyncio
import os

from flowrl.lifecycle import PARENT_ENV, die_with_parent, take_niceness

if __name__ == "__main__":
    # An agent started by its actor: armed before the imports below (torch: seconds), so an
    # actor killed meanwhile leaves no agent behind.
    die_with_parent()

import contextlib
import importlib
import ipaddress
import sys
from typing import TYPE_CHECKING, Any

import structlog

from flowrl.controller import RunError
from flowrl.recipe import RayConfig, RayResources
from flowrl.spawn import start_child, stop_child
from transport.curve import ENV as KEYS_ENV

if TYPE_CHECKING:
    from flowrl.controller import Controller
    from flowrl.node_hub import NodeHub

__all__ = ["RayAgents", "import_ray"]

log = structlog.get_logger("flowrl.ray_placement")


def import_ray() -> Any:
    """The ``ray`` module; ImportError saying how to install it when it is missing."""
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise ImportError("placement.kind='ray' needs Ray: pip install 'flowrl[ray]'") from exc


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _AgentActor:
    """The Ray actor of one node: starts and stops that node's agent process."""

    def __init__(self, node: str, controller: str, keys: str, host: str | None,
                 orphan_s: float, niceness: int) -> None:
        self.node = node
        self.controller = controller
        self.keys = keys
        self.host = host or import_ray().util.get_node_ip_address()
        self.orphan_s = orphan_s
        self.niceness = niceness
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> dict[str, Any]:
        """Start the agent; returns its pid and the address its store binds."""
        argv = [sys.executable, "-m", "flowrl.ray_placement", "--controller", self.controller,
                "--node", self.node, "--host", self.host, "--orphan-s", str(self.orphan_s)]
        # Ray runs its workers at niceness 15 (its daemons stay responsive); the agent and the
        # node's workers, which inherit it, are the run's compute: they take the controller's.
        got = take_niceness(self.niceness)
        if got > self.niceness:
            log.warning("the node agent and its workers keep Ray's low CPU priority: lowering "
                        "niceness needs root, CAP_SYS_NICE or RLIMIT_NICE", node=self.node,
                        niceness=got, wanted=self.niceness)
        env = {**os.environ, KEYS_ENV: self.keys, PARENT_ENV: str(os.getpid())}
        self.proc = await start_child(*argv, env=env, stdin=asyncio.subprocess.DEVNULL)
        return {"pid": self.proc.pid, "host": self.host}

    async def stop(self, grace_s: float) -> int | None:
        """Stop the agent (TERM, then KILL after `grace_s`); its exit code."""
        return None if self.proc is None else await stop_child(self.proc, grace_s)


class RayAgents:
    """Node agents as Ray actors for one run (an async context manager).

    ``async with RayAgents(config) as agents``: joins Ray (``ray.init(address=config.address)``
    unless Ray is initialized already); `host` is then this machine's address as Ray sees it.
    `start_controller` starts the controller and the agents it waits for together; leaving the
    context stops the agents and kills their actors. Close the controller first (`run_recipe`
    does): its stop broadcast lets the agents leave on their own.
    """

    def __init__(self, config: RayConfig, *, orphan_s: float = 30.0,
                 stop_s: float = 10.0) -> None:
        self.config = config
        self.orphan_s = orphan_s
        #: how long an agent has to stop before it is killed.
        self.stop_s = stop_s
        self._ray: Any = None
        self._owns_ray = False
        self._actors: dict[str, Any] = {}
        #: what each agent reported when it started: node -> {"pid", "host"}.
        self.started: dict[str, dict[str, Any]] = {}

    async def __aenter__(self) -> RayAgents:
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            # Seconds of blocking work, so off the loop; off the main thread, Ray also leaves the
            # SIGTERM handler alone (run_recipe's stops the run cleanly, Ray included).
            await asyncio.to_thread(ray.init, address=self.config.address)
            self._owns_ray = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def host(self) -> str:
        """This machine's address as Ray's nodes reach it (Ray's own choice)."""
        return str(self._ray.util.get_node_ip_address())

    def request(self, node: str) -> RayResources:
        """What `node`'s actor requests."""
        return self.config.nodes.get(node, self.config.agent)

    async def start_controller(self, ctl: Controller) -> None:
        """``await ctl.start()`` while the agents it waits for start; the first failure of
        either is raised (the controller's join timeout bounds the wait for agents Ray
        cannot place)."""
        hub = ctl.nodes
        if hub is None:  # every role on the controller's node: no agent to start
            await ctl.start()
            return
        tasks = [asyncio.ensure_future(ctl.start()),
                 asyncio.ensure_future(self._start(hub, ctl.run_id))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                exc = t.exception() if t.done() else None
                if isinstance(exc, RunError) and (unstarted := self._unstarted()):
                    raise RunError(f"{exc}; {await self._why_unstarted(unstarted)}") from exc
                if exc is not None:
                    raise exc
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _unstarted(self) -> list[str]:
        """The nodes whose actor Ray has not started (yet)."""
        return [n for n in self._actors if n not in self.started]

    def _demand(self, node: str) -> dict[str, float]:
        """What `node`'s actor asks of a Ray node, in Ray's resource names."""
        req = self.request(node)
        out = {"CPU": req.num_cpus, "GPU": req.num_gpus, **req.resources}
        return {k: v for k, v in out.items() if v > 0}

    async def _offered(self) -> list[dict[str, float]] | None:
        """The total resources of each live Ray node; None where Ray does not say (the
        diagnosis is a courtesy: no failure of it may stop a placement)."""
        try:
            nodes = await asyncio.to_thread(self._ray.nodes)
            return [dict(n["Resources"]) for n in nodes if n.get("Alive")]
        except Exception as exc:  # any Ray or Ray Client error: no diagnosis, no failure
            log.debug("Ray's nodes unknown", error=repr(exc))
            return None

    def _fits(self, node: str, offered: list[dict[str, float]] | None) -> bool:
        """Whether some live Ray node has, in all, what `node`'s actor requests (True when
        unknown)."""
        demand = self._demand(node)
        return offered is None or any(all(o.get(k, 0.0) >= v for k, v in demand.items())
                                      for o in offered)

    async def _why_unstarted(self, nodes: list[str]) -> str:
        """Says, for each node, what its actor requests and whether any live Ray node has
        that much at all (if none has, waiting longer would not have helped)."""
        offered = await self._offered()
        return "; ".join(
            f"Ray did not start node {node!r}'s agent: it requests {self._demand(node)}, "
            + ("which no live Ray node offers" if not self._fits(node, offered)
               else "which Ray did not free or start in time")
            for node in nodes)

    async def _start(self, hub: NodeHub, run_id: str) -> None:
        ray = self._ray
        endpoint = await hub.wait_listening()
        # A controller on loopback means a one-machine run: the stores stay on loopback too.
        host = "127.0.0.1" if _is_loopback(hub.config.host) else None
        actor_cls = ray.remote(_AgentActor)
        offered = await self._offered()
        for node in hub.nodes:
            if not self._fits(node, offered):  # said now: the run fails only at the join timeout
                log.warning("no live Ray node offers what a node agent requests", node=node,
                            requests=self._demand(node), join_timeout_s=hub.config.join_timeout_s)
            req = self.request(node)
            self._actors[node] = actor_cls.options(
                name=f"flowrl-{run_id}-{node}", num_cpus=req.num_cpus, num_gpus=req.num_gpus,
                resources=dict(req.resources), max_restarts=0,
            ).remote(node, endpoint, hub.keys.to_json(), host, self.orphan_s,
                     os.getpriority(os.PRIO_PROCESS, 0))

        async def start(node: str) -> None:
            self.started[node] = await self._actors[node].start.remote()

        await asyncio.gather(*(start(n) for n in self._actors))
        log.info("ray placed node agents", run_id=run_id, agents=self.started)

    async def aclose(self) -> None:
        """Stop every agent, kill every actor, shut Ray down if this object started it."""
        ray, actors = self._ray, self._actors
        self._actors = {}
        try:
            # An actor Ray never placed has no agent to stop (and would never answer).
            started = [n for n in actors if n in self.started]
            if started:
                stops = [actors[n].stop.remote(self.stop_s) for n in started]
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.stop_s + 5.0):
                        codes = await asyncio.gather(*stops, return_exceptions=True)
                        log.info("node agents stopped", codes=dict(
                            zip(started, [c if isinstance(c, int | None) else repr(c)
                                          for c in codes], strict=True)))
        finally:
            for a in actors.values():
                ray.kill(a)  # the agent gets its parent-death signal, if it is still there
            # A call to a killed actor fails once Ray has it dead (its resources released).
            dead = [a.__ray_ready__.remote() for a in actors.values()]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.stop_s):
                    await asyncio.gather(*dead, return_exceptions=True)
            if self._owns_ray:
                self._owns_ray = False
                await asyncio.to_thread(ray.shutdown)


def _agent_main() -> None:
    """An agent started by its actor: ``python -m flowrl.node`` that dies with the actor (armed
    at this module's start; its environment names the actor, `PARENT_ENV`)."""
    from flowrl.node import main

    main(sys.argv[1:])


if __name__ == "__main__":
    _agent_main()
