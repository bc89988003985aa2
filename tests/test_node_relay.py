"""Node agents relay the controller's broadcasts to their workers and gather the workers'
``served`` reports into one ``node_served`` per node (`flowrl.node_relay`).

Real controller, node agents (the controller's own and one on node ``a`` over tcp+curve) and
worker processes on the simulated engine.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from flowrl import messages as m
from flowrl.controller import Controller, RunError
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from tests.test_multinode import FAST, agents_reaped, start_joined, wait_exit
from transport.curve import CurveKeys
from transport.errors import TransportError
from transport.rpc import RpcClient

ROLLOUT = 6


def spec(rollout_nodes: tuple[str, ...] = ("node0",)) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=ROLLOUT, per_process=ROLLOUT // len(rollout_nodes),
                        nodes=rollout_nodes),
               PoolSpec("reward", count=1), PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=1,
        engine="sim", engine_config=FAST, store_capacity_bytes=32 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


class Served:
    """Counts the controller's ``served``, ``heartbeat`` and node agents' requests (wrapped
    before it starts), and wakes `wait` after each one is handled."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.calls = {"served": 0, "node_served": 0, "heartbeat": 0, "node_heartbeat": 0}
        #: workers' ``served`` reports carried by the ``node_served`` requests
        self.entries = 0
        self._handled = asyncio.Event()
        api: Any = ctl.api
        for op in self.calls:
            name = f"_{op}"
            inner = getattr(api, name)

            def counted(p: Any, peer: bytes, inner: Any = inner, op: str = op) -> Any:
                self.calls[op] += 1  # these handlers answer at once (`transport.rpc.Handler`)
                if op == "node_served" and isinstance(p, dict):
                    self.entries += len(p.get("served") or ())
                try:
                    return inner(p, peer)
                finally:
                    self._handled.set()
            setattr(api, name, counted)

    async def wait(self, version: int) -> None:
        """Until every rollout worker serves ``version`` as far as the controller knows."""
        await self.wait_for(
            lambda: all(w.version >= version for w in self.ctl.registry.of_role("rollout")))

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Until ``done()`` holds, checked after each request handled."""
        async with asyncio.timeout(30):
            while not done():
                self._handled.clear()
                await self._handled.wait()


@pytest.mark.timeout(120)
async def test_the_controller_sees_a_nodes_workers_serve_a_version_from_gathered_reports(
) -> None:
    ctl = Controller(spec(), start_timeout_s=60)
    served = Served(ctl)
    async with ctl:
        out = await ctl.run(steps=3, timeout_s=60)
        await served.wait(ctl.version)
        await served.wait_for(lambda: served.calls["node_heartbeat"] >= 1)
        assert ctl.workforce.endpoints.relay  # this node's workers report to its agent
        published = ctl._pub
        assert published is not None
        assert published.joined == 1  # only the agent subscribes
    assert out["version"] == 3
    assert out["rows_trained_twice"] == 0
    calls = served.calls
    # No worker reported to the controller itself; its agent passed its heartbeats on.
    assert calls["served"] == calls["heartbeat"] == 0
    assert calls["node_heartbeat"] >= 1
    # The node's workers' reports arrive in its agent's requests, one in flight at a time and
    # what waits meanwhile in the next: never more requests than reports. (Fewer when the
    # workers load a version together; on busy cores they may not, so no fewer is asserted.)
    assert 1 <= calls["node_served"] <= served.entries, (calls, served.entries)


@pytest.mark.timeout(120)
async def test_a_worker_gone_before_its_node_reports_is_not_counted_as_serving() -> None:
    ctl = Controller(spec(), start_timeout_s=60)
    served = Served(ctl)
    async with ctl:
        await ctl.run(steps=1, timeout_s=60)
        await served.wait(1)
        workers = ctl.registry.of_role("rollout")
        pid, tokens = workers[0].pid, {w.worker_id: w.token for w in workers}
        # The process dies (all its workers) before its agent's report names them.
        psutil.Process(pid).send_signal(signal.SIGKILL)
        async with asyncio.timeout(30):
            await ctl.wait_for(lambda: not ctl.registry.by_pid(pid))
        assert ctl.registry.versions("rollout") == set()
        report = {"node": ctl.node, "token": ctl._own_node_token, "dropped": [],
                  "served": [[w, t, 5] for w, t in tokens.items()]}
        async with RpcClient(ctl.workforce.endpoints.controller) as rpc:
            reply = await rpc.call(m.OP_NODE_SERVED, report)
            assert reply == {"ok": True, "served": 0}
            assert ctl.registry.versions("rollout") == set()  # none of them counts
            # Their heartbeats, passed on late, renew nothing: the agent is told they are gone.
            beats = {"node": ctl.node, "token": ctl._own_node_token,
                     "workers": [[w, t] for w, t in tokens.items()]}
            reply = await rpc.call(m.OP_NODE_HEARTBEAT, beats)
            assert sorted(reply["unknown"]) == sorted(tokens)
            # Only the node's agent reports for it: another token is refused outright.
            with pytest.raises(TransportError, match="without its token"):
                await rpc.call(m.OP_NODE_SERVED, {**report, "token": b"x" * 16})
            with pytest.raises(TransportError, match="without its token"):
                await rpc.call(m.OP_NODE_SERVED, {**report, "node": "elsewhere"})
        # The restarted process's workers report through the agent as before.
        async with asyncio.timeout(60):
            await ctl.wait_for(lambda: len(ctl.registry.of_role("rollout")) == ROLLOUT)
        out = await ctl.run(steps=1, timeout_s=60)
        await served.wait(ctl.version)
    assert out["rows_trained_twice"] == 0


@pytest.mark.timeout(120)
async def test_a_remote_nodes_workers_are_relayed_and_losing_its_only_rollout_node_ends_the_run(
        tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    ctl = Controller(spec(("a",)), cluster=ClusterConfig(keys=keys, node_timeout_s=3.0),
                     start_timeout_s=60)
    assert ctl.nodes is not None
    served = Served(ctl)
    log = tmp_path / "a.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            await start_joined(ctl, "a", log, keys, procs)
            await ctl.run(steps=2, timeout_s=60)
            await served.wait(ctl.version)
            assert served.calls["served"] == served.calls["heartbeat"] == 0
            assert served.calls["node_served"] >= 1
            # Heartbeats are passed on every half second: a fast run may end before the first.
            await served.wait_for(lambda: served.calls["node_heartbeat"] >= 1)
            family = psutil.Process(procs[0].pid).children(recursive=True)
            assert family  # its worker process
            procs[0].send_signal(signal.SIGKILL)
            # Every rollout worker was there: the run cannot go on without the node.
            with pytest.raises(RunError, match="node agent 'a' stopped answering and no "
                               "rollout worker is left on any other node"):
                await ctl.run(steps=20, timeout_s=60)
        finally:
            await ctl.aclose()
        await wait_exit(procs[0], log)
    # Its workers die with it (parent-death signal): none is left.
    _, alive = psutil.wait_procs(family, timeout=30)
    assert not alive
