"""Colocated placement's parts: what a recipe may ask of it, how the controller keeps a
process's two workers from working at once, how the process's phases take turns and what
the trainer gives up between them, and the two roles built over one module.

The end-to-end run (equal losses, strict alternation, a killed process recovered) is in
tests/test_sync_equivalence.py."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from flowrl import messages as m
from flowrl.recipe import (
    LoraConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.recipe.placement import ClusterSettings
from flowrl.registry import Registry
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_launch import process_spec
from workers.colocated import ColocatedTrainer, Phases, PhaseSpan, RolloutMemory, TrainerMemory
from workers.engines import TorchTrainerEngine
from workers.runtime import RoleOutput

pytestmark = pytest.mark.timeout(60)


# ---- the recipe ---------------------------------------------------------------------------------


def test_mixed_placement_validates_and_hosts_the_rollout_in_the_trainer_process(
        tmp_path: Path) -> None:
    # Trainer and rollout engine share node1's process; reward stays a pool of its own.
    recipe = Recipe(steps=1, placement=PlacementConfig(
        mode="colocated", roles={"train": ("node1",), "rollout": ("node1",),
                                 "reward": ("node0",)},
        cluster=ClusterSettings(keys_file=str(tmp_path / "keys"))))
    pipeline = recipe.to_pipeline()
    assert pipeline.colocated
    assert pipeline.keep_weight_copy
    train = process_spec(pipeline, role="train", proc_no=0, count=1, capacity=1, threads=1,
                         engine_config=pipeline.engine_config, start_token="0" * 16)
    assert train.colocated is not None
    assert train.colocated.role == "rollout"
    reward = process_spec(pipeline, role="reward", proc_no=0, count=1, capacity=1, threads=1,
                          engine_config=pipeline.engine_config, start_token="0" * 16)
    assert reward.colocated is None
    assert Recipe(steps=1).to_pipeline().colocated is False  # separated stays the default


def test_colocated_placement_takes_the_vllm_engine(tmp_path: Path) -> None:
    # vLLM reloads its own layout from the trainer's tensors in the process: no dtype rule.
    recipe = Recipe(steps=1, rollout=RolloutConfig(engine="vllm", dtype="bfloat16"),
                    placement=PlacementConfig(mode="colocated"))
    pipeline = recipe.to_pipeline()
    assert pipeline.colocated
    assert pipeline.engine == "vllm"
    train = process_spec(pipeline, role="train", proc_no=0, count=1, capacity=1, threads=1,
                         engine_config=pipeline.engine_config, start_token="0" * 16)
    assert train.engine == "vllm"
    assert train.colocated is not None
    # What vLLM cannot serve from one trainer's module is refused as on hf, naming the field.
    with pytest.raises(ValidationError, match=r"trainer.ranks: colocated placement on vllm"):
        Recipe(steps=1, rollout=RolloutConfig(engine="vllm"), trainer=TrainerConfig(ranks=2),
               placement=PlacementConfig(mode="colocated"))
    with pytest.raises(ValidationError, match=r"model.lora: colocated placement serves whole"):
        Recipe(steps=1, rollout=RolloutConfig(engine="vllm"),
               model=ModelConfig(lora=LoraConfig()), placement=PlacementConfig(mode="colocated"))


def test_colocated_placement_refuses_what_it_cannot_serve_in_place() -> None:
    with pytest.raises(ValidationError, match=r"placement.mode: colocated placement serves "
                       r"the trainer's weights on the hf or vllm engine; rollout.engine is "
                       r"'sim'"):
        Recipe(steps=1, rollout=RolloutConfig(engine="sim"),
               placement=PlacementConfig(mode="colocated"))
    with pytest.raises(ValidationError, match=r"keep_weight_copy: only colocated placement"):
        PlacementConfig(keep_weight_copy=False)
    with pytest.raises(ValidationError, match=r"node 'node1' has no trainer"):
        Recipe(steps=1, model=ModelConfig(), placement=PlacementConfig(
            mode="colocated", roles={"rollout": ("node1",)},
            cluster=ClusterSettings(keys_file="/tmp/k")))


def test_data_parallel_ranks_colocate_one_rollout_engine_each() -> None:
    for sharding in ("replicate", "fsdp2"):
        pipeline = Recipe(steps=1, trainer=TrainerConfig(ranks=2, groups_per_step=2,
                                                         sharding=sharding),
                          rollout=RolloutConfig(workers=2),
                          placement=PlacementConfig(mode="colocated")).to_pipeline()
        assert pipeline.colocated
        assert [(p.role, p.count) for p in pipeline.pools if p.role in ("train", "rollout")] \
            == [("rollout", 2), ("train", 2)]
    # One engine in each rank's process: as many rollout workers as ranks.
    with pytest.raises(ValidationError, match=r"rollout.workers: colocated placement hosts one "
                       r"rollout engine in each trainer process: 2 \(trainer.ranks\), got 1"):
        Recipe(steps=1, trainer=TrainerConfig(ranks=2, groups_per_step=2),
               placement=PlacementConfig(mode="colocated"))
    # What stays refused with ranks too: adapters, and engines on nodes without their rank.
    with pytest.raises(ValidationError, match=r"model.lora: colocated placement serves whole"):
        Recipe(steps=1, model=ModelConfig(lora={"rank": 2}),
               trainer=TrainerConfig(ranks=2, groups_per_step=2),
               rollout=RolloutConfig(workers=2), placement=PlacementConfig(mode="colocated"))
    with pytest.raises(ValidationError, match=r"placement.roles.rollout: colocated placement "
                       r"runs each rollout engine in a trainer process"):
        Recipe(steps=1, trainer=TrainerConfig(ranks=2, groups_per_step=2),
               rollout=RolloutConfig(workers=2), placement=PlacementConfig(
                   mode="colocated", roles={"train": ("node0", "node1"),
                                            "rollout": ("node1", "node0")},
                   cluster=ClusterSettings(keys_file="/tmp/k",
                                           trainer_rendezvous="cluster")))


# ---- the controller: a process's two workers never work at once -------------------------------


def test_colocated_workers_take_turns_and_separate_ones_do_not() -> None:
    reg = Registry(10.0)
    train = reg.register(name="train.0.0", role="train", node="node0", pid=7, capacity=1,
                         version=0, now=0.0)
    rollout = reg.register(name="train.0.1", role="rollout", node="node0", pid=7, capacity=1,
                           version=0, now=0.0)
    other = reg.register(name="reward.0.0", role="reward", node="node0", pid=8, capacity=1,
                         version=0, now=0.0)
    assert train.partner is rollout
    assert rollout.partner is train
    assert other.partner is None
    reg.assign(rollout, 1, 10)
    assert reg.least_loaded("train") is None  # its process is generating
    assert reg.least_loaded("reward") is other
    reg.finish(rollout, 1, ok=True)
    assert reg.least_loaded("train") is train
    reg.assign(train, 2, 10)
    assert reg.least_loaded("rollout") is None  # and now training
    # Same pid on another node is another process; a gone partner frees the survivor.
    elsewhere = reg.register(name="train.0.1", role="rollout", node="node1", pid=7,
                             capacity=1, version=0, now=0.0)
    assert elsewhere.partner is None
    reg.remove(train.worker_id)
    assert rollout.partner is None
    assert reg.least_loaded("rollout") is not None
    # The process's worker registering again (its role restarted in place) pairs up again.
    again = reg.register(name="train.0.0", role="train", node="node0", pid=7, capacity=1,
                         version=0, now=0.0)
    assert (again.partner, rollout.partner) == (rollout, again)


def test_simulated_workers_of_one_role_in_one_process_are_not_partners() -> None:
    reg = Registry(10.0)
    a = reg.register(name="rollout.0.0", role="rollout", node="node0", pid=7, capacity=1,
                     version=0, now=0.0)
    b = reg.register(name="rollout.0.1", role="rollout", node="node0", pid=7, capacity=1,
                     version=0, now=0.0)
    reg.assign(a, 1, 10)
    assert a.partner is None
    assert reg.least_loaded("rollout") is b
    # Workers of several roles that one test process hosts are not one colocated process.
    c = reg.register(name="train.0.0", role="train", node="node0", pid=7, capacity=1,
                     version=0, now=0.0)
    assert c.partner is None


# ---- the process: phases ------------------------------------------------------------------------


class _Counting:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def release(self) -> int:
        self.calls.append("release")
        return 1 << 20

    def restore(self) -> int:
        self.calls.append("restore")
        return 1 << 20


async def test_phases_never_overlap_and_switch_only_between_phases() -> None:
    train, generate = _Counting(), _Counting()
    phases = Phases({"train": train, "generate": generate})
    inside: list[str] = []
    overlaps = 0
    guard = threading.Lock()

    def work(phase: str) -> None:  # real work off the event loop, as the roles run it
        nonlocal overlaps
        with guard:
            overlaps += bool(inside)
            inside.append(phase)
        torch.randn(64, 64) @ torch.randn(64, 64)
        time.sleep(0.002)
        with guard:
            inside.remove(phase)

    async def task(phase: str) -> None:
        async with phases.enter(phase):  # type: ignore[arg-type]
            await asyncio.to_thread(work, phase)

    await asyncio.gather(*(task(p) for p in ["generate", "train"] * 8 + ["train"] * 4))
    assert overlaps == 0
    spans: list[PhaseSpan] = sorted(phases.history, key=lambda s: s.start)
    assert len(spans) == 20
    assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
    changes = 1 + sum(a.phase != b.phase for a, b in itertools.pairwise(spans))
    assert phases.switches == changes
    # Each switch releases the phase left and restores the phase entered, in that order.
    assert train.calls.count("restore") == sum(s.phase == "train" for s in _starts(spans))
    metrics = phases.take_metrics()
    assert metrics["phase_switches"] == changes
    assert metrics["phase_rss_mb_train"] > 0
    assert metrics["phase_moved_mb"] == train.calls.count("release") + generate.calls.count(
        "release") + train.calls.count("restore") + generate.calls.count("restore")
    assert phases.take_metrics()["phase_switches"] == 0  # since the last step's line


class _RecordingTrainer:
    """A trainer role that records, for each task it runs, the phase its process is in."""

    def __init__(self, phases: Phases) -> None:
        self.phases = phases
        self.version = 0
        self.exports_weights = True
        self.ran: list[tuple[int, int, str | None]] = []  # (task id, attempt, phase)

    async def run(self, task: m.TaskMsg, inputs: dict[str, Any]) -> RoleOutput:
        await asyncio.sleep(0)
        params = task["params"]
        self.ran.append((task["task_id"], params.get("attempt", 0), self.phases.current))
        assert torch.equal(inputs["x"][0], torch.tensor([task["task_id"]]))
        if not params.get("step_end"):
            return RoleOutput(fields={})
        self.version += 1
        return RoleOutput(fields={}, version=self.version, metrics={})

    async def load_version(self, version: int, weights: dict[str, Any]) -> None:
        self.version = version


def _task(task_id: int, *, end: bool, step: int = 0, attempt: int = 0) -> Any:
    return {"task_id": task_id, "params": {"step": step, "step_end": end, "attempt": attempt}}


async def test_a_sharded_rank_trains_its_micro_batches_in_the_step_ends_train_phase() -> None:
    # A sharded rank's passes are collectives: each waits for every peer. Kept until the
    # step's end (which every rank gets at once), they never hold the train phase while the
    # process's own engine still has to generate what a peer waits for.
    phases = Phases({"train": _Counting(), "generate": _Counting()})
    role = _RecordingTrainer(phases)
    rank1 = ColocatedTrainer(role, phases, keep_weight_copy=False, announces=False, defers=True)
    store_view = torch.tensor([1])  # the store's memory: reused once the task is done

    async def generate() -> None:
        async with phases.enter("generate"):
            await asyncio.sleep(0.01)

    gen = asyncio.ensure_future(generate())
    await asyncio.sleep(0)  # the engine generates
    out = await rank1.run(_task(1, end=False), {"x": [store_view]})
    store_view.fill_(9)
    assert out.version is None
    assert out.metrics == {"deferred": 1.0}
    assert role.ran == []  # not trained yet, and no phase taken:
    assert phases.current == "generate"
    await gen
    out = await rank1.run(_task(2, end=True), {"x": [torch.tensor([2])]})
    assert role.ran == [(1, 0, "train"), (2, 0, "train")]  # in the step end's train phase
    assert out.version == 1
    assert out.weights is None  # a rank > 0 announces nothing: rank 0 does
    assert [s.phase for s in phases.history] == ["generate", "train"]
    assert all(a.end <= b.start for a, b in itertools.pairwise(phases.history))
    # A redone step drops the failed attempt's micro-batches.
    await rank1.run(_task(3, end=False, step=1), {"x": [torch.tensor([3])]})
    await rank1.run(_task(4, end=False, step=1, attempt=1), {"x": [torch.tensor([4])]})
    await rank1.run(_task(5, end=True, step=1, attempt=1), {"x": [torch.tensor([5])]})
    assert role.ran[2:] == [(4, 1, "train"), (5, 1, "train")]
    # Rank 0 announces the version served in place (no copy kept): empty weights.
    rank0 = ColocatedTrainer(_RecordingTrainer(phases), phases, keep_weight_copy=False,
                             defers=True)
    await rank0.run(_task(6, end=False), {"x": [torch.tensor([6])]})
    assert (await rank0.run(_task(7, end=True), {"x": [torch.tensor([7])]})).weights == {}


def _starts(spans: list[PhaseSpan]) -> list[PhaseSpan]:
    """The spans that began a stretch of their phase."""
    return [s for i, s in enumerate(spans) if i == 0 or spans[i - 1].phase != s.phase]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("colocated") / "tiny")


def test_the_trainer_moves_optimizer_state_and_gradients_out_and_back(model_dir: Path) -> None:
    engine = TorchTrainerEngine(model_dir, device="cpu", lr=1e-2)
    ids = torch.randint(0, 50, (2, 6))
    engine.model(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer.step()  # optimizer state exists from here
    engine.model(input_ids=ids, labels=ids).loss.backward()  # a step part-way: gradients
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    state = {id(p): {k: v.clone() for k, v in s.items()}
             for p, s in engine.optimizer.state.items()}
    assert TrainerMemory(engine).release() == 0  # on a CPU host is device: nothing to move
    memory = TrainerMemory(engine, offloads=True)  # the accelerator's path, host to host
    moved = memory.release()
    assert moved >= sum(g.numel() * 4 for g in grads.values()) * 3  # grads + two moments
    assert all(p.grad is None for p in engine.model.parameters())
    assert memory.release() == 0  # released once
    assert memory.restore() == moved
    for n, p in engine.model.named_parameters():
        assert torch.equal(p.grad, grads[n])
    for p, s in engine.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k])
    engine.optimizer.step()  # and the optimizer steps on
    assert RolloutMemory(torch.device("cpu")).release() == 0


# ---- the worker side: two roles over one module -------------------------------------------------


def test_the_rollout_engine_generates_with_the_trainers_module(model_dir: Path) -> None:
    from workers.colocated import ColocatedRollout, ColocatedTrainer
    from workers.roles.factory import make_colocated_roles

    config = Recipe(steps=1, model=ModelConfig(path=str(model_dir))).engine_spec()
    train, rollout = make_colocated_roles(config, 0, keep_weight_copy=False)
    assert isinstance(train, ColocatedTrainer)
    assert isinstance(rollout, ColocatedRollout)
    assert rollout.role.engine.model is train.role.engine.model  # type: ignore[attr-defined]
    assert train.role.exports_weights is False  # no copy: the step end announces none
    # Another layout would need a copy (resharding): refused, naming the field.
    halves = config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"dtype": "bfloat16"})})
    with pytest.raises(ValueError, match=r"rollout.dtype: resolves to torch.bfloat16 on cpu, "
                       r"but the colocated trainer holds torch.float32"):
        make_colocated_roles(halves, 0, keep_weight_copy=True)


async def test_a_restarted_process_without_a_weight_copy_says_why_it_cannot_join(
        model_dir: Path) -> None:
    from workers.roles.factory import make_colocated_roles

    config = Recipe(steps=1, model=ModelConfig(path=str(model_dir))).engine_spec()
    train, _rollout = make_colocated_roles(config, 0, keep_weight_copy=False)
    with pytest.raises(RuntimeError, match=r"joins the run at policy version 3, but no copy "
                       r"of those weights exists \(placement.keep_weight_copy = false\)"):
        await train.load_version(3, {})
    # Its own version coming back (a step end's broadcast) takes no phase: generation, which
    # may have begun meanwhile, is not interrupted.
    await train.load_version(0, {})
    assert train.phases.current is None  # type: ignore[attr-defined]
