"""``max_staleness = 0`` trains exactly what a plain synchronous loop trains.

The run goes through everything a real job does — controller, admission, rollout, reward and
train processes, the shared-memory store, streamed micro-batches, weight publishing — and its
per-step losses must equal, to 1e-6, those of the loop below: generate the step's groups with
the current weights, score them, compute the GRPO loss over the whole step's batch, backward,
one optimizer step. Sampling is keyed by (run seed, dataset position) (`prompt_seeds`), so the
loop draws the same responses without knowing how the run batched or placed its groups.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Literal

import pytest
import torch

from flowrl.algorithms import compute_policy_loss, grpo_advantages
from flowrl.controller import Controller
from flowrl.recipe import (
    AlgorithmConfig,
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
from workers.engines import HFRolloutEngine, SamplingParams, SequenceBatch, TorchTrainerEngine
from workers.engines.protocols import mix_seed
from workers.roles.builtin_rewards import numeric_partial_credit
from workers.roles.factory import dataset_from_config, load_tokenizer

pytestmark = pytest.mark.timeout(240)

STEPS = 3
GROUP = 4
GROUPS_PER_STEP = 4
SEED = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A short warm start on arithmetic lines, so responses earn rewards and the loss is not 0.
    return build_tiny_model(tmp_path_factory.mktemp("sync") / "tiny", vocab_size=300,
                            corpus_kind="arithmetic", pretrain_steps=40)


@pytest.fixture(scope="module")
def recipe(model: Path) -> Recipe:
    return make_recipe(model)


def make_recipe(model: Path, placement: PlacementConfig | None = None, *, ranks: int = 1,
                sharding: Literal["replicate", "fsdp2"] = "replicate") -> Recipe:
    return Recipe(
        steps=STEPS, max_staleness=0, seed=SEED,
        model=ModelConfig(path=str(model)),
        data=DataConfig(arithmetic=ArithmeticConfig(max_operand=5)),
        algorithm=AlgorithmConfig(group_size=GROUP),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=4, groups_per_task=2,
                              workers=ranks),
        reward=RewardConfig(fn="workers.roles.builtin_rewards:numeric_partial_credit_batch",
                            batched=True),
        # Two micro-batches per step: the run streams them, the loop takes the step at once.
        trainer=TrainerConfig(lr=1e-3, groups_per_step=GROUPS_PER_STEP, micro_batch_groups=2,
                              grad_clip=1.0, ranks=ranks, sharding=sharding,
                              # several buckets a version, when the ranks export
                              export_bucket_mb=1 / 16),
        placement=placement or PlacementConfig(),
    )


def plain_loop(recipe: Recipe) -> list[dict[str, float]]:
    """The reference: one process, no orchestration, the step's whole batch at once."""
    config = recipe.engine_config()
    model_dir = Path(config["model"]["path"])
    dataset = dataset_from_config(config)
    tok = load_tokenizer(model_dir)
    rollout = HFRolloutEngine(model_dir, device="cpu")
    t, algo = recipe.trainer, config["algorithm"]
    trainer = TorchTrainerEngine(model_dir, device="cpu", lr=t.lr, weight_decay=t.weight_decay,
                                 betas=t.betas, grad_clip=t.grad_clip,
                                 warmup_steps=t.warmup_steps)
    pad = int(trainer.model.config.pad_token_id or trainer.model.config.eos_token_id)
    losses = []
    for step in range(STEPS):
        positions = range(step * GROUPS_PER_STEP, (step + 1) * GROUPS_PER_STEP)
        prompts = [tok(dataset.at(p).prompt).input_ids for p in positions]
        params = SamplingParams(
            temperature=recipe.rollout.temperature, max_new_tokens=recipe.rollout.max_new_tokens,
            n=GROUP, prompt_seeds=tuple(mix_seed(recipe.seed, p) for p in positions))
        gens = rollout.generate(prompts, params)
        texts = tok.batch_decode([g.response_ids.tolist() for g in gens],
                                 skip_special_tokens=True)
        rewards = torch.tensor([
            numeric_partial_credit(dataset.at(p).prompt, text, answer=dataset.at(p).answer)
            for p, text in zip([p for p in positions for _ in range(GROUP)], texts, strict=True)
        ])
        groups = torch.arange(len(positions)).repeat_interleave(GROUP)
        seqs = SequenceBatch.from_rows([torch.tensor(prompts[g]) for g in groups.tolist()],
                                       [g.response_ids for g in gens], pad_token_id=pad)
        mask = seqs.response_mask
        rollout_lps = torch.zeros(mask.shape)
        rollout_lps[mask] = torch.cat([g.logprobs for g in gens])
        adv = grpo_advantages(rewards, groups)

        def loss_fn(lps: torch.Tensor, s: SequenceBatch,
                    adv: torch.Tensor = adv, rollout_lps: torch.Tensor = rollout_lps,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
            return compute_policy_loss(
                lps, lps.detach(), adv, s.response_mask, clip_eps_low=algo["clip_low"],
                clip_eps_high=algo["clip_high"], loss_agg=algo["loss_agg"],
                max_tokens=recipe.rollout.max_new_tokens,
                num_tokens=float(s.num_response_tokens), num_seqs=float(len(s.input_ids)),
                rollout_logprobs=rollout_lps, tis_cap=None)

        out = trainer.train_micro_batch(seqs, loss_fn, temperature=recipe.rollout.temperature)
        stats = trainer.optimizer_step()
        rollout.load_weights(trainer.export_weights(), step + 1)
        losses.append({"loss": out["loss"], "grad_norm": stats["grad_norm"],
                       "reward_mean": float(rewards.mean())})
    return losses


def losses_of(ctl: Controller) -> list[dict[str, float]]:
    return [{k: float(e[f"train_{k}"]) for k in ("loss", "grad_norm", "reward_mean")}
            for e in ctl.step_log]


def assert_equals_plain_loop(recipe: Recipe, run: list[dict[str, float]]) -> None:
    # The workers compute with one torch thread; so does the loop (same reduction order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = plain_loop(recipe)
    finally:
        torch.set_num_threads(threads)
    assert len(run) == STEPS
    # Identical samples (same rewards), then the same losses and gradients.
    assert [r["reward_mean"] for r in run] == pytest.approx(
        [e["reward_mean"] for e in expected], abs=1e-6)
    assert all(e["grad_norm"] > 1e-3 for e in expected)  # a step that learns nothing proves little
    assert [r["loss"] for r in run] == pytest.approx([e["loss"] for e in expected], abs=1e-6, rel=0)
    assert [r["grad_norm"] for r in run] == pytest.approx(
        [e["grad_norm"] for e in expected], rel=1e-5)


async def test_staleness_zero_equals_a_plain_synchronous_loop(recipe: Recipe) -> None:
    assert recipe.tis_cap is None  # off at staleness 0: nothing to correct
    spec = compile_recipe(recipe)
    async with Controller(spec) as ctl:
        summary = await ctl.run(STEPS, timeout_s=180)
        run = losses_of(ctl)
    assert summary["rows_trained_twice"] == 0
    assert summary["staleness"] == {0: STEPS * GROUPS_PER_STEP * GROUP}
    assert_equals_plain_loop(recipe, run)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_colocated_placement_trains_the_same_and_recovers_a_killed_process(
        model: Path) -> None:
    # One process hosts the trainer and the rollout engine (generating with the trainer's
    # module); reward stays a process of its own. At staleness 0 it trains what the plain
    # loop trains (and so what separated placement trains, above).
    recipe = make_recipe(model, PlacementConfig(mode="colocated"))
    spec = compile_recipe(recipe)
    async with Controller(spec) as ctl:
        pids = {r: ctl.worker_pids(r) for r in ("rollout", "train")}
        summary = await ctl.run(STEPS, timeout_s=180)
        run = losses_of(ctl)
        phases = [e["train_phase_switches"] for e in ctl.step_log]
        assert summary["rows_trained_twice"] == 0
        assert pids["rollout"] == pids["train"]
        assert len(pids["train"]) == 1
        # Strict alternation: each step switches to generate once and to train once (the
        # first from no phase); a micro-batch trained between two generate tasks would add two.
        assert phases == [2.0] * STEPS
        assert all(e["train_phase_rss_mb_generate"] > 0 for e in ctl.step_log)
        # A process killed as its next phase begins (a step just committed) is restarted like
        # any worker, joins at the current version from the store's copy, and the run goes on
        # training each row once.
        victim = pids["train"][0]
        more = asyncio.ensure_future(ctl.run(3, timeout_s=150))
        await ctl.wait_for(lambda: ctl.version >= STEPS + 1)
        os.kill(victim, signal.SIGKILL)
        assert ctl.version < STEPS + 3  # the last steps need the restarted process
        after = await more
        assert ctl.restarts >= 1
        assert victim not in ctl.worker_pids("train")
        assert ctl.worker_pids("train") == ctl.worker_pids("rollout")
    assert after["version"] == STEPS + 3
    assert after["rows_trained_twice"] == 0
    assert_equals_plain_loop(recipe, run)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["colocated", "separated"])
@pytest.mark.parametrize("sharding", ["replicate", "fsdp2"])
async def test_data_parallel_ranks_train_the_same_colocated_or_separated(
        model: Path, mode: Literal["colocated", "separated"],
        sharding: Literal["replicate", "fsdp2"]) -> None:
    # Two trainer ranks and two rollout engines, in two processes (colocated: each hosts a
    # rank and an engine) or four. Colocated replicated ranks generate with their own module;
    # colocated FSDP2 ranks load the gathered weights into an engine of their own at every
    # step's end. At staleness 0 every way trains what the plain loop trains, so colocated
    # trains what separated does.
    recipe = make_recipe(model, PlacementConfig(mode=mode), ranks=2, sharding=sharding)
    spec = compile_recipe(recipe)
    async with Controller(spec) as ctl:
        pids = {r: sorted(ctl.worker_pids(r)) for r in ("rollout", "train")}
        summary = await ctl.run(STEPS, timeout_s=240)
        run = losses_of(ctl)
        log = list(ctl.step_log)
        if mode == "colocated" and sharding == "fsdp2":
            # A rank's process killed: the group restarts (both processes, trainers and
            # engines), joins from the store's copy, and the run trains each row once.
            more = asyncio.ensure_future(ctl.run(2, timeout_s=200))
            await ctl.wait_for(lambda: ctl.version >= STEPS + 1)
            os.kill(pids["train"][1], signal.SIGKILL)
            after = await more
            assert ctl.restarts >= 1
            assert after["version"] == STEPS + 2
            assert after["rows_trained_twice"] == 0
            assert sorted(ctl.worker_pids("train")) == sorted(ctl.worker_pids("rollout"))
            assert pids["train"][1] not in ctl.worker_pids("train")
    assert summary["rows_trained_twice"] == 0
    assert len(pids["train"]) == 2
    assert (pids["rollout"] == pids["train"]) == (mode == "colocated")
    assert all(e["train_ranks"] == 2.0 for e in log)
    if mode == "colocated" and sharding == "fsdp2":
        # Every step's end loaded the engine, bucket by bucket; and the train phase is entered
        # once a step (the step's micro-batches wait for its end): at most one switch to
        # generate and one to train.
        assert all(e["train_engine_sync_s"] > 0 for e in log)
        assert all(e["train_engine_sync_buckets"] > 1 for e in log)
        assert all(e["train_phase_switches"] <= 2 for e in log)
    else:
        assert not any("train_engine_sync_s" in e for e in log)
    assert_equals_plain_loop(recipe, run)
