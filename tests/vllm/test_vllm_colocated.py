"""Colocated placement on vLLM (`workers.colocated_vllm`): the trainer and vLLM in one process,
each version loaded from the trainer's own tensors.

Runs only where vLLM is installed (``make test-vllm``). The in-process tests share the suite's
one engine (`conftest.py`) and put its weights back; the runs start worker processes of their
own (one engine each). On the CPU build vLLM has no sleep mode: the sleep and wake-up path runs
on a CUDA machine (``bench/device_check.py``).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip("vllm", minversion="0.32")

import torch

from flowrl.controller import Controller
from flowrl.recipe import (
    ArithmeticConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.run import compile_recipe
from flowrl.tiny_model import build_tiny_model
from workers.colocated import Phases, TrainerMemory
from workers.colocated_vllm import VLLMInPlace, colocated_llm_kwargs, module_buckets
from workers.engines import SamplingParams, SequenceBatch, TorchTrainerEngine
from workers.engines.vllm_rollout import VLLMRolloutEngine

VERSION = 3  # the shared engine's (`conftest.py`)
PROMPTS = [[18, 19, 12, 24, 30], [21, 22, 11, 20, 30, 18], [5]]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, prompt_seeds=(1, 2, 3))
STEPS = 3


def _served(worker: Any) -> dict[str, torch.Tensor]:
    """vLLM's parameters, copied (runs on vLLM's in-process worker)."""
    model = worker.model_runner.get_model()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sample(engine: VLLMRolloutEngine) -> list[tuple[list[int], list[float]]]:
    return [(g.response_ids.tolist(), g.logprobs.tolist())
            for g in engine.generate(PROMPTS, SAMPLED)]


def _step(trainer: TorchTrainerEngine) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    resp = torch.zeros_like(ids, dtype=torch.bool)
    resp[:, 4:] = True
    batch = SequenceBatch(ids, torch.ones_like(ids), resp)
    trainer.train_micro_batch(batch, lambda lps, b: -(lps * b.response_mask.to(lps.dtype)).sum())
    trainer.optimizer_step()


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("restore")
async def test_phases_load_the_trainers_tensors_as_the_store_route_would(
        engine: VLLMRolloutEngine, model_dir: Path) -> None:
    trainer = TorchTrainerEngine(model_dir, device="cpu", lr=1e-2)
    version = VERSION
    served = VLLMInPlace(engine, lambda: module_buckets(trainer.model), lambda: version)
    assert not served.sleeps  # the CPU build has no sleep mode
    assert colocated_llm_kwargs() == {}  # so a colocated engine is built without it
    phases = Phases({"train": TrainerMemory(trainer), "generate": served})
    async with phases.enter("train"):
        _step(trainer)
        version += 1
    async with phases.enter("generate"):  # the switch loads the stepped tensors
        assert engine.version == version
        served.serve_in_place(version)  # loaded already: nothing to do
        colocated = _sample(engine)
        vllm_params = engine.llm.collective_rpc(_served)[0]
    assert served.last_load is not None
    assert served.last_load[0] == version
    # By reference, but never aliased: vLLM holds copies in its own layout.
    own = {p.data_ptr() for p in trainer.model.parameters()}
    assert not any(p.data_ptr() in own for p in vllm_params.values())
    # What vLLM holds as the checkpoint lays it out (the CPU build packs linear weights into
    # its GEMM's format, shape (0,)) is the trainer's bit for bit; fused ones concatenated.
    trainer_params = dict(trainer.model.named_parameters())
    compared = []
    for name, p in vllm_params.items():
        if p.numel() == 0:  # packed
            continue
        if name in trainer_params:
            expected = trainer_params[name]
        else:
            assert name.endswith("qkv_proj.bias"), name
            expected = torch.cat([trainer_params[name.replace("qkv_proj", proj)]
                                  for proj in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(p, expected), name
        compared.append(name)
    assert "model.embed_tokens.weight" in compared
    assert "model.layers.0.self_attn.qkv_proj.bias" in compared
    # The separated route: a copy of the same weights through `load_weights`. The same
    # samples and logprobs, exactly.
    engine.load_weights(trainer.export_weights(), version)
    assert _sample(engine) == colocated
    # A bucketed source (a sharded trainer's, one bucket gathered at a time) plugs in as a
    # generator over buckets: drawn one by one as vLLM takes them, the same weights served.
    drawn: list[int] = []

    def buckets() -> Iterator[dict[str, torch.Tensor]]:
        names = list(trainer_params)
        for i in range(0, len(names), 7):
            drawn.append(i)
            yield {n: trainer_params[n].detach() for n in names[i:i + 7]}

    engine.load_weight_stream(buckets(), version)
    assert len(drawn) > 2
    assert _sample(engine) == colocated
    # Another train phase: no sleep mode, so nothing is released; a step moves the version on
    # and the next generate phase loads it; a phase without a step loads nothing.
    async with phases.enter("train"):
        _step(trainer)
        version += 1
    async with phases.enter("generate"):
        stepped = _sample(engine)
    loads = served.last_load
    async with phases.enter("train"):
        pass
    async with phases.enter("generate"):
        assert _sample(engine) == stepped
    assert served.last_load is loads
    assert stepped != colocated
    metrics = phases.take_metrics()
    assert metrics["phase_switches"] == 6
    assert metrics["phase_moved_mb"] == 0.0  # CPU: the trainer offloads nothing either
    history = list(phases.history)
    assert all(a.end <= b.start for a, b in itertools.pairwise(history))


@pytest.mark.usefixtures("restore")
def test_a_bad_stream_fails_inside_vllm_and_the_engine_serves_its_checkpoint(
        engine: VLLMRolloutEngine, other_weights: dict[str, torch.Tensor]) -> None:
    engine.load_weights(other_weights, VERSION + 1)
    bad = dict(other_weights)
    bad.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match=r"missing weights.*serves version 3"):
        engine.load_weight_stream(iter([bad]), VERSION + 2)
    assert engine.version == VERSION


# ---- runs: colocated against separated, at max_staleness = 0 ---------------------------------


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Warm-started on arithmetic lines, so responses earn rewards and the loss is not 0.
    return build_tiny_model(tmp_path_factory.mktemp("coloc") / "tiny", vocab_size=300,
                            corpus_kind="arithmetic", pretrain_steps=40)


def _recipe(model: Path, mode: str) -> Recipe:
    return Recipe(
        steps=STEPS, max_staleness=0, seed=5,
        model=ModelConfig(path=str(model)),
        data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
        rollout=RolloutConfig(engine="vllm", dtype="float32", temperature=1.0,
                              max_new_tokens=4, groups_per_task=2),
        reward=RewardConfig(fn="workers.roles.builtin_rewards:numeric_partial_credit_batch",
                            batched=True),
        trainer=TrainerConfig(lr=1e-3, groups_per_step=4, micro_batch_groups=2, grad_clip=1.0),
        placement=PlacementConfig(mode=mode),  # type: ignore[arg-type]
    )


async def _run(recipe: Recipe) -> tuple[list[dict[str, float]], dict[str, Any]]:
    async with Controller(compile_recipe(recipe)) as ctl:
        summary = await ctl.run(STEPS, timeout_s=240)
        if recipe.placement.mode == "colocated":
            assert ctl.worker_pids("rollout") == ctl.worker_pids("train")
        return list(ctl.step_log), summary


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_colocated_vllm_run_trains_what_a_separated_one_trains(warm_model: Path) -> None:
    colocated = await _run(_recipe(warm_model, "colocated"))
    separated = await _run(_recipe(warm_model, "separated"))
    for log, summary in (separated, colocated):
        assert summary["version"] == STEPS
        assert summary["rows_trained_twice"] == 0
        assert len(log) == STEPS
    sep, col = separated[0], colocated[0]
    # Strict alternation: each step switches to generate once and to train once.
    assert [e["train_phase_switches"] for e in col] == [2.0] * STEPS
    assert any(e["train_grad_norm"] > 1e-3 for e in col)  # it learns something
    for key in ("train_reward_mean", "train_loss", "train_grad_norm"):
        assert [e[key] for e in col] == pytest.approx([e[key] for e in sep], abs=1e-6, rel=0), key
