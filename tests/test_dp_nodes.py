"""Data-parallel trainer ranks on several nodes (the opt-in ``trainer_rendezvous="cluster"``).

A real run: rank 0 on the controller's node, rank 1 on node ``b`` (a node agent started by the
test), meeting in the TCPStore the controller hosts and stepping a real tiny model with gloo.
A rank that dies takes the group down: the controller kills the rest of it, on the other node
through that node's agent, and starts every rank again. Also: the recipe's rule and its way out, the
controller's refusal without the opt-in, and the rendezvous store's binding and lifetime.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist
from pydantic import ValidationError
from test_dp_trainer import REWARD
from test_multinode import agents_reaped, start_agent, wait_exit

from flowrl.controller import Controller
from flowrl.node_hub import ClusterConfig, NodeHub
from flowrl.recipe import (
    AlgorithmConfig,
    ClusterSettings,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.rendezvous import RankRendezvous
from flowrl.run import cluster_config
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_spec import DataParallelSpec
from workers.distributed import DataParallel, split_address

pytestmark = pytest.mark.timeout(60)


def two_nodes(keys_file: Path | None, *, opt_in: bool) -> PlacementConfig:
    return PlacementConfig(
        roles={"train": ("node0", "b")}, max_restarts=2,
        cluster=ClusterSettings(keys_file=None if keys_file is None else str(keys_file),
                                trainer_rendezvous="cluster" if opt_in else "node"))


# ---- the recipe and the controller's rule ------------------------------------------------------


def test_ranks_on_several_nodes_need_the_opt_in_which_the_refusal_names(tmp_path: Path) -> None:
    trainer = TrainerConfig(ranks=2, groups_per_step=4)
    with pytest.raises(ValidationError, match=r"placement\.cluster\.trainer_rendezvous"):
        Recipe(steps=1, trainer=trainer, placement=two_nodes(tmp_path / "k", opt_in=False))
    recipe = Recipe(steps=1, trainer=trainer, placement=two_nodes(tmp_path / "k", opt_in=True))
    spec = recipe.to_pipeline()
    assert spec.pool("train").nodes == ("node0", "b")  # type: ignore[union-attr]
    config = cluster_config(recipe)
    assert config is not None
    assert config.trainer_rendezvous == "cluster"
    # The default stays one node; a controller given such a spec without the opt-in refuses.
    assert ClusterSettings().trainer_rendezvous == "node"
    with pytest.raises(ValueError, match=r"trainer_rendezvous='cluster'"):
        Controller(spec, cluster=ClusterConfig())
    # Ranks on one node other than the controller's still meet in a file there.
    one = Recipe(steps=1, trainer=trainer, placement=PlacementConfig(
        roles={"train": ("b", "b")}, cluster=ClusterSettings(keys_file=str(tmp_path / "k"))))
    assert Controller(one.to_pipeline(), cluster=ClusterConfig()).workforce.rendezvous is None


def test_a_rank_meets_in_the_store_or_in_a_file_never_both() -> None:
    section = DataParallelSpec(world=2, sharding="replicate", compute_dtype="float32",
                               store="10.0.0.1:29500", generation=3)
    group = DataParallel.of_process(section, process="train.1", run_dir=Path("/tmp/flowrl-x"))
    assert (group.rank, group.store, group.generation, group.init_method) == (
        1, "10.0.0.1:29500", 3, "")
    assert split_address("[::1]:29500") == ("::1", 29500)
    with pytest.raises(ValueError, match="exactly one"):
        DataParallel(rank=0, world=2)
    with pytest.raises(ValueError, match="exactly one"):
        DataParallel(rank=0, world=2, init_method="file:///x", store="h:1")
    for bad in ("nohost", "h:0", "h:port", ":29500", "h:70000"):
        with pytest.raises(ValueError, match="host:port"):
            DataParallel(rank=0, world=2, store=bad)


def test_the_store_binds_the_cluster_address_only_and_goes_when_closed() -> None:
    rdzv = RankRendezvous("127.0.0.1", timeout_s=5)
    address = rdzv.start()
    host, port = split_address(address)
    try:
        listening = [c for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert [c.laddr.ip for c in listening] == ["127.0.0.1"]  # not every interface
        client = dist.TCPStore(host, port, is_master=False,  # type: ignore[attr-defined]
                               timeout=datetime.timedelta(seconds=5))
        # Each generation of a group sees only its own keys.
        dist.PrefixStore("g1", client).set("rank0", b"x")
        assert not dist.PrefixStore("g2", client).check(["rank0"])
        assert dist.PrefixStore("g1", client).get("rank0") == b"x"
        del client
    finally:
        rdzv.close()
    assert not [c for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    with pytest.raises(RuntimeError, match="not started"):
        _ = rdzv.address


async def test_a_kill_order_is_done_once_its_own_node_acknowledges_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("flowrl.node_hub._KILL_S", 0.1)
    hub = NodeHub("r", {"b", "c"}, ClusterConfig(node_timeout_s=0.5), capacity=1,
                  on_lost=lambda node: None, on_exit=lambda *exit_: None)
    stopping = asyncio.ensure_future(hub.stop_workers("b", ["train.1"]))
    reply = await hub._poll({"node": "b", "wait_s": 5.0}, b"")  # answered at once
    assert reply["kill"] == [{"id": 1, "names": ["train.1"]}]
    assert reply["spawn"] == []
    assert not reply["stop"]
    assert (await hub._poll({"node": "c", "wait_s": 0.01}, b""))["kill"] == []
    await hub._stopped({"node": "c", "id": 1}, b"")  # not c's order
    await asyncio.sleep(0)
    assert not stopping.done()
    await hub._stopped({"node": "b", "id": 1}, b"")
    await asyncio.wait_for(stopping, 1.0)
    await hub._stopped({"node": "b", "id": 1}, b"")  # a repeat is harmless
    # An agent that never acknowledges: the controller gives up (and fails the run).
    with pytest.raises(TimeoutError):
        await hub.stop_workers("c", ["train.2"])


# ---- a real run on two nodes -------------------------------------------------------------------


@pytest.mark.timeout(360)
async def test_two_ranks_on_two_nodes_stay_in_sync_and_restart_together(
    tmp_path: Path,
) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", vocab_size=300)
    (tmp_path / "reward.py").write_text(REWARD)
    keys_file = tmp_path / "keys.json"
    recipe = Recipe(
        steps=2, model=ModelConfig(path=str(model_dir)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=2),
        reward=RewardConfig(fn=f"{tmp_path / 'reward.py'}:response_length"),
        rollout=RolloutConfig(max_new_tokens=4, groups_per_task=2),
        trainer=TrainerConfig(lr=1e-3, groups_per_step=4, micro_batch_groups=1, ranks=2),
        placement=two_nodes(keys_file, opt_in=True),
    )
    ctl = Controller(recipe.to_pipeline(), cluster=cluster_config(recipe), start_timeout_s=120)
    assert ctl.nodes is not None
    log = tmp_path / "b.log"
    procs: list[asyncio.subprocess.Process] = []
    async with agents_reaped(procs):
        try:
            starting = asyncio.ensure_future(ctl.start())
            endpoint = await ctl.nodes.wait_listening()
            procs.append(await start_agent(endpoint, "b", log, keys_file=keys_file))
            await starting
            # The ranks were told to meet in the controller's store.
            section = ctl.workforce.engine_config()["data_parallel"]
            assert split_address(section["store"])[0] == "127.0.0.1"
            out = await ctl.run(steps=2, timeout_s=120)
            assert out["version"] == 2
            assert out["rows_trained_twice"] == 0
            assert ctl.status()["errors"] == []
            ranks = {w.node: w.pid for w in ctl.registry.of_role("train")}
            assert set(ranks) == {"node0", "b"}  # one rank on each node
            # Each step was committed from both ranks' ends, which agreed on their parameters
            # (the controller stops the run when they do not); the parameters moved.
            log_ = ctl.step_log
            assert [s["train_ranks"] for s in log_] == [2.0, 2.0]
            assert len({s["train_param_checksum"] for s in log_}) == 2
            published = [e["version"] for e in ctl.events.recent if e["kind"] == "version"]
            assert published == [1, 2]  # one weight export per step

            # The rank here dies: the controller has node b's agent kill the other rank (and
            # waits until it has) and starts both again in a fresh generation of the store's
            # keys. Then the rank on node b dies: its agent reports it, and the same happens.
            for generation, victim in enumerate(("node0", "b"), start=1):
                ranks = {w.node: w.pid for w in ctl.registry.of_role("train")}
                run = asyncio.ensure_future(ctl.run(steps=1, timeout_s=120))
                if victim == "node0":
                    ctl.kill_worker_process(ranks[victim])
                else:
                    os.kill(ranks[victim], signal.SIGKILL)
                out = await run
                assert out["version"] == 2 + generation
                assert out["rows_trained_twice"] == 0
                assert ctl.restarts == generation
                again = {w.node: w.pid for w in ctl.registry.of_role("train")}
                assert set(again) == {"node0", "b"}
                assert not set(ranks.values()) & set(again.values())  # both ranks are new
                assert not any(psutil.pid_exists(pid) for pid in ranks.values())
                section = ctl.workforce.engine_config()["data_parallel"]
                assert section["generation"] == generation
                assert ctl.step_log[-1]["train_ranks"] == 2.0
        finally:
            await ctl.aclose()
        assert await wait_exit(procs[0], log) == 0
