"""Runs across node agents: separate processes, each with its own node name and store.

Rollout runs on node ``a``, reward and train on node ``b``: every reward and train task reads
its inputs from the other node's store server (tcp+curve), and every rollout worker reads the
trainer's weights the same way. The controller's own node holds no worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Literal

import psutil
import pytest

from flowrl.controller import Controller, RunError
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from transport.curve import CurveKeys
from transport.endpoints import remove_run_dir
from transport.rpc import RpcClient

FAST = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}
EXIT_S = 30.0  # bound on an agent's exit once its controller stopped or vanished
ROOT = Path(__file__).resolve().parents[1]


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def split_spec() -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(
            PoolSpec("rollout", count=2, per_process=2, nodes=("a",)),
            PoolSpec("reward", count=1, nodes=("b",)),
            PoolSpec("train", count=1, nodes=("b",)),
        ),
        group_size=4, groups_per_step=4, max_staleness=1,
        engine="sim", engine_config=FAST, store_capacity_bytes=32 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


async def start_agent(endpoint: str, node: str, log: Path, *, keys_file: Path | None = None,
                      env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
                      host: str = "127.0.0.1",
                      orphan_s: float = 30.0) -> asyncio.subprocess.Process:
    argv = [*prefix, sys.executable, "-m", "flowrl.node", "--controller", endpoint,
            "--node", node, "--host", host, "--orphan-s", str(orphan_s)]
    if keys_file is not None:
        argv += ["--keys", str(keys_file)]
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            env={**os.environ, **(env or {})}, cwd=ROOT)


async def start_joined(ctl: Controller, node: str, log: Path, keys: CurveKeys,
                       procs: list[asyncio.subprocess.Process]) -> asyncio.subprocess.Process:
    """Start ``ctl`` with ``node``'s agent (under ``keys``, added to ``procs`` to be reaped
    before the start is awaited); returns the agent."""
    assert ctl.nodes is not None
    starting = asyncio.ensure_future(ctl.start())
    endpoint = await ctl.nodes.wait_listening()
    procs.append(await start_agent(endpoint, node, log, env=keys.to_env()))
    await starting
    return procs[-1]


async def wait_exit(proc: asyncio.subprocess.Process, log: Path) -> int:
    try:
        async with asyncio.timeout(EXIT_S):
            return await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        pytest.fail(f"agent did not exit within {EXIT_S}s; its log:\n{tail(log)}")


@contextlib.asynccontextmanager
async def agents_reaped(procs: list[asyncio.subprocess.Process]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("data_plane", ["encrypted", "plaintext"])
async def test_a_run_across_two_node_agents_reads_across_nodes(
    tmp_path: Path, data_plane: Literal["encrypted", "plaintext"]
) -> None:
    keys = CurveKeys.generate()
    keys_file = keys.save(tmp_path / "keys.json")
    ctl = Controller(split_spec(), cluster=ClusterConfig(keys=keys, data_plane=data_plane),
                     start_timeout_s=60)
    assert ctl.nodes is not None
    procs: list[asyncio.subprocess.Process] = []
    logs = {n: tmp_path / f"{n}.log" for n in "ab"}
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            endpoint = await ctl.nodes.wait_listening()
            assert endpoint.startswith("tcp://127.0.0.1:")
            # One agent gets the keys by file, the other by environment.
            procs.append(await start_agent(endpoint, "a", logs["a"], keys_file=keys_file))
            procs.append(await start_agent(endpoint, "b", logs["b"], env=keys.to_env()))
            await starting
            out = await ctl.run(steps=4, timeout_s=60)
            status = ctl.status()
            stats = ctl.store_stats
            # The controller's own node's agent (started with --data-plane) advertises too.
            async with RpcClient(ctl.nodes.peers["node0"], curve=keys) as rpc:
                own = (await rpc.call("hello"))["plaintext"]
        finally:
            await ctl.aclose()
        codes = [await wait_exit(p, logs[n]) for p, n in zip(procs, "ab", strict=True)]
    assert codes == [0, 0]  # both left on the stop broadcast
    assert (own is not None) == (data_plane == "plaintext")
    assert out["version"] == 4
    assert out["samples"] == 4 * 4 * 4
    assert out["rows_trained_twice"] == 0
    placed = {(w["role"], w["node"]) for w in status["workers"]}
    assert placed == {("rollout", "a"), ("reward", "b"), ("train", "b")}
    assert status["worker_deaths"] == 0
    assert set(stats["nodes"]) == {"node0", "a", "b"}  # every node's store answered frees
    if data_plane == "encrypted":
        assert not any("plaintext" in node for node in stats["nodes"].values())
    else:
        # Train and reward on b read a's rollouts, rollout on a reads b's weights: unencrypted,
        # every request authenticated.
        for node in "ab":
            reads = stats["nodes"][node]["plaintext"]
            assert reads["accepted"] > 0
            assert sum(reads.values()) == reads["accepted"], reads


@pytest.mark.timeout(120)
async def test_a_worker_on_another_node_keeps_the_weight_sync_deadline(tmp_path: Path) -> None:
    # The rollout worker runs on node a and takes 30 s to load each version against a 0.5 s
    # deadline: it must report the miss and exit, and the run stops naming it (a worker that
    # did not get the deadline would wait 60 s and the run would time out instead).
    keys = CurveKeys.generate()
    stuck = dataclasses.replace(
        split_spec(), pools=(PoolSpec("rollout", count=1, nodes=("a",)),
                             PoolSpec("reward", count=1), PoolSpec("train", count=1)),
        engine_config={**FAST, "weight_load_s": 30.0}, weight_sync_timeout_s=0.5,
        max_restarts=0, max_staleness=0)
    ctl = Controller(stuck, cluster=ClusterConfig(keys=keys), start_timeout_s=60)
    assert ctl.nodes is not None
    log = tmp_path / "a.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            procs.append(await start_agent(await ctl.nodes.wait_listening(), "a", log,
                                           env=keys.to_env()))
            await starting
            with pytest.raises(RunError, match=r"rollout\.0 died") as info:
                await ctl.run(steps=3, timeout_s=40)
            errors = [e for e in ctl.status()["errors"] if e.get("stage") == "weight_sync"]
        finally:
            await ctl.aclose()
        await wait_exit(procs[0], log)
    assert "did not load policy version 1 within 0.5s" in str(info.value), tail(log)
    assert errors
    assert errors[0]["name"] == "rollout.0.0"


@pytest.mark.timeout(60)
async def test_a_worker_on_another_node_that_cannot_start_stops_the_run_with_its_error(
        tmp_path: Path) -> None:
    # Every worker runs on node a with a cost model it refuses: the first to say why (over
    # tcp+curve, before it registers) stops the run at once, with no restart.
    keys = CurveKeys.generate()
    broken = dataclasses.replace(
        split_spec(), pools=tuple(dataclasses.replace(p, nodes=("a",))
                                  for p in split_spec().pools),
        engine_config={**FAST, "bogus_cost": 1.0})
    ctl = Controller(broken, cluster=ClusterConfig(keys=keys), start_timeout_s=50)
    assert ctl.nodes is not None
    log = tmp_path / "a.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            procs.append(await start_agent(await ctl.nodes.wait_listening(), "a", log,
                                           env=keys.to_env()))
            with pytest.raises(RunError) as info:
                await starting
        finally:
            await ctl.aclose()
        await wait_exit(procs[0], log)
    assert re.fullmatch(r"worker process (rollout|reward|train)\.0 failed to start: "
                        r"ValueError: unknown simulation cost field\(s\): \['bogus_cost'\]",
                        str(info.value)), (str(info.value), tail(log))
    assert ctl.restarts == 0


@pytest.mark.timeout(60)
async def test_an_unknown_node_or_a_peer_without_keys_is_refused(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    ctl = Controller(split_spec(), cluster=ClusterConfig(keys=keys, join_timeout_s=3.0),
                     start_timeout_s=30)
    assert ctl.nodes is not None
    log = tmp_path / "agents.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            endpoint = await ctl.nodes.wait_listening()
            procs.append(await start_agent(endpoint, "zzz", log, env=keys.to_env()))
            procs.append(await start_agent(endpoint, "a", log, orphan_s=1.0))  # no keys
            with pytest.raises(RuntimeError, match=r"did not join .*missing \['a', 'b'\]"):
                await starting
        finally:
            await ctl.aclose()
        codes = [await wait_exit(p, log) for p in procs]
    assert all(code != 0 for code in codes), log.read_text()[-3000:]
    assert "not part of this run" in log.read_text()


CONTROLLER = """
import asyncio
from flowrl.controller import Controller
from flowrl.logs import configure
from flowrl.node_hub import ClusterConfig
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from transport.curve import CurveKeys

async def main() -> None:
    configure()  # logs to stderr: stdout carries the endpoint and "ready"
    spec = PipelineSpec(
        stages=grpo_stages(group_size=4),
        pools=(PoolSpec("rollout", nodes=("a",)), PoolSpec("reward"), PoolSpec("train")),
        group_size=4, groups_per_step=2, engine="sim", store_capacity_bytes=8 << 20)
    ctl = Controller(spec, cluster=ClusterConfig(keys=CurveKeys.from_env()))
    starting = asyncio.ensure_future(ctl.start())
    print(ctl.run_id, await ctl.nodes.wait_listening(), flush=True)
    await starting
    print("ready", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.timeout(90)
async def test_agents_exit_when_their_controller_vanishes(tmp_path: Path) -> None:
    keys = CurveKeys.generate()
    log = tmp_path / "a.log"
    env = {**os.environ, **keys.to_env()}
    ctl = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CONTROLLER, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env,
        cwd=ROOT)
    procs = [ctl]
    run_id = ""
    async with agents_reaped(procs):
        try:
            assert ctl.stdout is not None
            async with asyncio.timeout(60):
                run_id, endpoint = (await ctl.stdout.readline()).decode().split()
                agent = await start_agent(endpoint, "a", log, env=keys.to_env(), orphan_s=2.0)
                procs.append(agent)
                assert (await ctl.stdout.readline()).strip() == b"ready"
            # Its local agent and workers die with it (parent-death signal); wait for them.
            family = psutil.Process(ctl.pid).children(recursive=True)
            ctl.send_signal(signal.SIGKILL)
            await ctl.wait()
            started = asyncio.get_running_loop().time()
            assert await wait_exit(agent, log) == 0
            assert asyncio.get_running_loop().time() - started < EXIT_S
            assert "controller gone" in log.read_text()
            psutil.wait_procs(family, timeout=EXIT_S)
        finally:
            if run_id:
                remove_run_dir(run_id)


@contextlib.contextmanager
def network_namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (name, host ip, namespace ip)."""
    tag = secrets.token_hex(3)
    ns, host_if, ns_if = f"flowrl-{tag}", f"fh{tag}", f"fn{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    try:
        ip("netns", "add", ns)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot create a network namespace here (needs CAP_NET_ADMIN): {exc}")
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        ip("link", "set", ns_if, "netns", ns)
        ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        ip("-n", ns, "link", "set", ns_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        yield ns, host_ip, ns_ip
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ip("link", "del", host_if)  # takes its peer in the namespace with it
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            ip("netns", "del", ns)


@pytest.mark.timeout(120)
async def test_a_node_in_another_network_namespace_over_a_veth_link(tmp_path: Path) -> None:
    with network_namespace() as (ns, host_ip, ns_ip):
        keys = CurveKeys.generate()
        spec = split_spec()
        # The trainer stays with the controller: reads cross the veth link both ways.
        spec = PipelineSpec(**{**spec.__dict__, "pools": (
            PoolSpec("rollout", count=2, per_process=2, nodes=("a",)),
            PoolSpec("reward", count=1, nodes=("a",)),
            PoolSpec("train", count=1))})
        ctl = Controller(spec, cluster=ClusterConfig(host=host_ip, keys=keys),
                         start_timeout_s=60)
        assert ctl.nodes is not None
        log = tmp_path / "a.log"
        procs: list[asyncio.subprocess.Process] = []
        async with agents_reaped(procs):
            try:
                starting = asyncio.ensure_future(ctl.start())
                endpoint = await ctl.nodes.wait_listening()
                assert endpoint.startswith(f"tcp://{host_ip}:")
                procs.append(await start_agent(endpoint, "a", log, env=keys.to_env(),
                                               prefix=("ip", "netns", "exec", ns),
                                               host=ns_ip))
                await starting
                out = await ctl.run(steps=2, timeout_s=60)
            finally:
                await ctl.aclose()
            assert await wait_exit(procs[0], log) == 0
        assert out["version"] == 2
        assert out["rows_trained_twice"] == 0
