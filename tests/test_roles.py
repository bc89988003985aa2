"""The real ("hf") roles on a tiny Qwen2 model, called directly with hand-built tasks: rollout
shapes and versions, reward failures, reference = trainer at init, exact streamed gradient
accumulation, a GRPO step that learns, weight export into a rollout engine, checkpoints."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from flowrl import messages as m
from flowrl.algorithms import (
    CorrectionKind,
    LossAgg,
    PolicyLoss,
    RolloutCorrection,
    compute_policy_loss,
    grpo_advantages,
    sampled_entropy,
)
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import (
    Generation,
    HFRolloutEngine,
    SamplingParams,
    SequenceBatch,
    TorchTrainerEngine,
)
from workers.engines.hf_rollout import load_causal_lm
from workers.roles.factory import dataset_from_config, load_tokenizer, make_hf_role
from workers.roles.reference import ReferenceRole
from workers.roles.reward_role import RewardRole
from workers.roles.rollout import RolloutRole
from workers.roles.trainer import AdvantageName, TrainBatch, TrainerRole, TrainSettings
from workers.runtime import RoleOutput

set_threads(2)
pytestmark = pytest.mark.timeout(60)

PAD = 1
MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("roles") / "tiny")


def engine_config(
    model_dir: Path, *, reward_fn: str = "workers.roles.builtin_rewards:exact_match",
    max_prompt_tokens: int = 64, lr: float = 1e-3, output: Path | None = None,
    checkpoint_every: int = 0, kl_coef: float = 0.0, algorithm: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a worker receives, through the real recipe compiler."""
    recipe = Recipe(
        steps=2,
        model=ModelConfig(path=str(model_dir)),
        data=DataConfig(max_prompt_tokens=max_prompt_tokens),
        algorithm=AlgorithmConfig(group_size=4, kl_coef=kl_coef, **(algorithm or {})),
        rollout=RolloutConfig(max_new_tokens=MAX_NEW, temperature=1.0),
        reward=RewardConfig(fn=reward_fn, timeout_s=5.0),
        trainer=TrainerConfig(lr=lr, groups_per_step=2, grad_clip=1.0),
        output=output,
        checkpoint_every=checkpoint_every,
    )
    return recipe.engine_config()


def task(rows: int, row_groups: Sequence[int], *, stage: str = "rollout",
         params: Mapping[str, Any] | None = None) -> m.TaskMsg:
    # A train task says the staleness in force, as the controller's do (tis_cap "auto").
    given = {**({"max_staleness": 0} if stage == "train" else {}), **(params or {})}
    return {"task_id": 1, "stage": stage, "rows": list(range(rows)),
            "groups": sorted(set(row_groups)), "row_groups": list(row_groups), "inputs": {},
            "params": given}


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


async def rollout_group(role: RolloutRole, position: int, n: int) -> RoleOutput:
    return await role.run(task(n, [0] * n), {"prompt": [position] * n})


def train_inputs(out: RoleOutput, rewards: Sequence[float]) -> dict[str, list[Any]]:
    f = out.fields
    return {"prompt_ids": f["prompt_ids"], "response_ids": f["response_ids"],
            "rollout_logprobs": f["rollout_logprobs"], "reward": list(rewards)}


# -- rollout ------------------------------------------------------------------------------------


async def test_rollout_outputs_are_aligned_and_versioned(model_dir: Path) -> None:
    config = engine_config(model_dir)
    role = make_hf_role("rollout", config, seed=0)
    assert isinstance(role, RolloutRole)
    dataset, tokenizer = dataset_from_config(config), role.tokenizer
    positions, groups = [5, 5, 5, 9, 9, 9], [10, 10, 10, 11, 11, 11]
    out = await role.run(task(6, groups), {"prompt": positions})

    f = out.fields
    assert out.version == 0
    assert out.lengths == [int(t.numel()) for t in f["response_ids"]]
    for i, pos in enumerate(positions):
        want = tokenizer(dataset.at(pos).prompt).input_ids
        assert f["prompt_ids"][i].tolist() == want
        assert f["prompt_ids"][i].dtype == torch.int64
        resp, lps = f["response_ids"][i], f["rollout_logprobs"][i]
        assert resp.dtype == torch.int64
        assert lps.dtype == torch.float32
        assert resp.dim() == 1
        assert resp.shape == lps.shape
        assert 1 <= resp.numel() <= MAX_NEW
        assert bool((lps <= 0).all())
        assert bool(torch.isfinite(lps).all())
    assert out.metrics["tokens"] == float(sum(out.lengths))

    # A new version is served once loaded; groups of another size take their own n.
    engine = role.engine
    assert isinstance(engine, HFRolloutEngine)
    await role.load_version(3, {k: v.clone() for k, v in engine.model.state_dict().items()})
    out = await role.run(task(2, [4, 4]), {"prompt": [1, 1]})
    assert out.version == 3
    assert len(out.lengths) == 2

    with pytest.raises(ValueError, match="mixes dataset positions"):
        await role.run(task(2, [4, 4]), {"prompt": [1, 2]})


async def test_rollout_truncates_prompts_to_their_last_tokens(model_dir: Path) -> None:
    role = make_hf_role("rollout", engine_config(model_dir, max_prompt_tokens=2), seed=0)
    assert isinstance(role, RolloutRole)
    full = role.tokenizer(role.dataset.at(0).prompt).input_ids
    assert len(full) > 2
    out = await rollout_group(role, 0, 2)
    assert [t.tolist() for t in out.fields["prompt_ids"]] == [full[-2:]] * 2
    assert out.metrics["prompts_truncated"] == 1.0


class GatedEngine:
    """A rollout engine whose generate waits for the test's event loop to release it."""

    def __init__(self, inner: HFRolloutEngine) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Generation]:
        self.entered.set()
        # Released by the event loop: this returns False (and the test fails) if generate
        # runs on the loop's own thread, which could then never release it.
        assert self.release.wait(10), "generation blocked the event loop"
        return self.inner.generate(prompts, params)

    def load_weights(
        self, state: Mapping[str, Tensor], version: int, *, shared: bool = False
    ) -> None:
        self.inner.load_weights(state, version, shared=shared)


async def test_rollout_generates_off_the_event_loop(model_dir: Path) -> None:
    config = engine_config(model_dir)
    engine = GatedEngine(HFRolloutEngine(model_dir, device="cpu", seed=0))
    role = RolloutRole(engine, load_tokenizer(model_dir), dataset_from_config(config),
                       SamplingParams(max_new_tokens=4), max_prompt_tokens=64)
    async with asyncio.TaskGroup() as tg:
        running = tg.create_task(rollout_group(role, 3, 2))
        async with asyncio.timeout(10):
            await asyncio.to_thread(engine.entered.wait, 10)
        assert engine.entered.is_set()
        assert not running.done()
        engine.release.set()  # the loop is free while generation is in flight
    assert len(running.result().lengths) == 2


# -- reward -------------------------------------------------------------------------------------


REWARD_FILE = """
def score(prompt, response, *, answer, **_):
    if answer == "boom":
        raise RuntimeError("reward exploded")
    return 1.0 if response.strip() == answer else 0.25
"""


async def test_reward_role_scores_decoded_text_and_survives_failures(
    model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "x", "answer": "boom"}\n')
    fn = tmp_path / "rewards.py"
    fn.write_text(REWARD_FILE)
    recipe = Recipe(steps=1, model=ModelConfig(path=str(model_dir)),
                    data=DataConfig(kind="jsonl", path=str(data)),
                    reward=RewardConfig(fn=f"{fn}:score"))
    config = recipe.engine_config()
    role = make_hf_role("reward", config, seed=0)
    assert isinstance(role, RewardRole)
    dataset = dataset_from_config(config)
    good = next(p for p in range(2) if dataset.at(p).answer == "2")
    bad = 1 - good
    tok = role.tokenizer
    eos = torch.tensor([tok.eos_token_id])
    right = torch.cat([torch.tensor(tok("2").input_ids), eos])  # EOS is skipped in decoding
    wrong = torch.tensor(tok("7").input_ids)
    out = await role.run(task(4, [0, 0, 1, 1], stage="reward"),
                         {"prompt": [good, good, bad, bad],
                          "response_ids": [right, wrong, right, wrong]})
    assert out.fields["reward"] == [1.0, 0.25, 0.0, 0.0]
    assert out.metrics["reward_failed"] == 2.0
    assert out.metrics["reward_failed_error"] == 2.0
    assert role.runner.statistics().failures["error"] == 2


# -- reference ----------------------------------------------------------------------------------


async def test_reference_logprobs_equal_trainer_logprobs_at_init(model_dir: Path) -> None:
    config = engine_config(model_dir, kl_coef=0.1)
    rollout = make_hf_role("rollout", config, seed=1)
    reference = make_hf_role("reference", config, seed=0)
    assert isinstance(rollout, RolloutRole)
    assert isinstance(reference, ReferenceRole)
    out = await rollout_group(rollout, 7, 3)
    inputs = {"prompt_ids": out.fields["prompt_ids"], "response_ids": out.fields["response_ids"]}
    ref = await reference.run(task(3, [0, 0, 0], stage="reference"), inputs)

    trainer = TorchTrainerEngine(model_dir, device="cpu")
    batch = SequenceBatch.from_rows(inputs["prompt_ids"], inputs["response_ids"],
                                    pad_token_id=PAD)
    want = batch.response_values(trainer.logprobs(batch, temperature=1.0))
    for got, exp, sampled in zip(ref.fields["ref_logprobs"], want, out.fields["rollout_logprobs"],
                                 strict=True):
        assert got.dtype == torch.float32
        assert got.shape == sampled.shape
        assert torch.equal(got, exp)
        # Aligned with the response tokens: the sampler's own logprobs agree.
        assert float((got - sampled).abs().max()) < 1e-4
    # Frozen: a new version does not reach it.
    await reference.load_version(1, {})
    again = await reference.run(task(3, [0, 0, 0], stage="reference"), inputs)
    assert all(torch.equal(a, b) for a, b in zip(again.fields["ref_logprobs"],
                                                 ref.fields["ref_logprobs"], strict=True))


# -- trainer ------------------------------------------------------------------------------------


class SpyEngine(TorchTrainerEngine):
    """Records the accumulated gradients the optimizer step sees (before clipping)."""

    grads: dict[str, Tensor]

    def optimizer_step(self) -> dict[str, float]:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}
        return super().optimizer_step()


def synthetic_groups(
    sizes: Sequence[int], seed: int, *, logprob_mean: float = -6.9
) -> dict[str, list[Any]]:
    """Groups of varied prompt/response lengths with rewards, rollout and ref logprobs. The
    default ``logprob_mean`` is near a random model's logprobs (about -ln 1024), so TIS weights
    straddle the cap."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[Any]] = {k: [] for k in ("prompt_ids", "response_ids", "rollout_logprobs",
                                                 "ref_logprobs", "reward")}
    for n in sizes:
        prompt = torch.randint(2, 300, (int(torch.randint(2, 9, (1,), generator=g)),),
                               generator=g)
        for _ in range(n):
            length = int(torch.randint(1, MAX_NEW * 2 + 1, (1,), generator=g))
            out["prompt_ids"].append(prompt)
            out["response_ids"].append(torch.randint(2, 300, (length,), generator=g))
            out["rollout_logprobs"].append(logprob_mean + 0.5 * torch.randn(length, generator=g))
            out["ref_logprobs"].append(logprob_mean + 0.3 * torch.randn(length, generator=g))
            out["reward"].append(float(torch.rand(1, generator=g)))
    return out


def concat(*parts: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


# (policy loss, loss aggregation, correction, its cap or bounds)
OBJECTIVES: list[tuple[PolicyLoss, LossAgg, CorrectionKind, Any]] = [
    ("ppo_clip", "token-mean", "tis", 1.5),
    ("ppo_clip", "seq-mean-token-mean", "tis", 1.5),
    ("ppo_clip", "seq-mean-token-sum-norm", "tis", 1.5),
    ("gspo", "seq-mean-token-mean", "seq_tis", 1.5),
    ("cispo", "token-mean", "mis", (0.5, 2.0)),
    ("ppo_clip", "token-mean", "icepop", (0.5, 2.0)),
]


@pytest.mark.parametrize(("policy_loss", "loss_agg", "kind", "setting"), OBJECTIVES,
                         ids=["-".join(case[:3]) for case in OBJECTIVES])
async def test_streamed_accumulation_equals_the_concatenated_batch(
    model_dir: Path, policy_loss: PolicyLoss, loss_agg: LossAgg, kind: CorrectionKind,
    setting: Any,
) -> None:
    # Micro-batches of different row and token counts: averaging micro-batch means is wrong.
    first, second = synthetic_groups([3, 3], seed=1), synthetic_groups([3], seed=2)
    groups_first, groups_second = [0, 0, 0, 1, 1, 1], [2, 2, 2]
    masks = kind in ("mis", "icepop")
    settings = TrainSettings(algorithm="grpo", policy_loss=policy_loss, loss_agg=loss_agg,
                             kl_coef=0.05, correction=kind, tis_cap=None if masks else setting,
                             mask_bounds=setting if masks else None,
                             max_new_tokens=MAX_NEW * 2, entropy_coef=0.01)
    correction = (RolloutCorrection(kind, bounds=setting) if masks
                  else RolloutCorrection(kind, cap=setting))
    engine = SpyEngine(model_dir, lr=1e-3, device="cpu", dtype=torch.float64)
    role = TrainerRole(engine, settings, pad_token_id=PAD)
    mid = await role.run(task(6, groups_first, stage="train",
                              params={"step": 0, "step_end": False}), first)
    assert mid.weights is None
    assert mid.version is None
    end = await role.run(task(3, groups_second, stage="train",
                              params={"step": 0, "step_end": True}), second)
    assert end.version == 1
    assert end.weights is not None

    # The reference: the loss of the whole step computed on the concatenated batch at once.
    full = TrainBatch.from_inputs(concat(first, second), groups_first + groups_second,
                                  pad_token_id=PAD)
    adv = grpo_advantages(full.rewards, full.group_ids)

    def loss_fn(lps: Tensor, seqs: SequenceBatch) -> tuple[Tensor, dict[str, float]]:
        return compute_policy_loss(
            lps, lps.detach(), adv, seqs.response_mask, policy_loss=policy_loss,
            loss_agg=loss_agg, max_tokens=MAX_NEW * 2, rollout_logprobs=full.rollout_logprobs,
            correction=correction, ref_logprobs=full.ref_logprobs, kl_coef=0.05,
            entropy=sampled_entropy(lps, seqs.response_mask), entropy_coef=0.01)

    whole = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu", dtype=torch.float64)
    want = whole.train_micro_batch(full.seqs, loss_fn)
    assert end.metrics["loss"] == pytest.approx(want["loss"], abs=1e-6, rel=1e-6)
    assert end.metrics["kl"] == pytest.approx(want["kl_loss"], abs=1e-6, rel=1e-6)
    assert end.metrics["tis_mean"] == pytest.approx(want["tis_mean"], abs=1e-6)
    if masks:  # the synthetic rows straddle the bounds: some are dropped, not all
        assert 0.0 < end.metrics["is_masked_frac"] < 1.0
        assert end.metrics["is_masked_frac"] == pytest.approx(want["is_masked_frac"], abs=1e-6)
    else:
        assert "is_masked_frac" not in end.metrics
    assert end.metrics["entropy"] == pytest.approx(want["entropy"], abs=1e-6)
    assert end.metrics["tokens"] == full.num_tokens
    grads = {n: p.grad for n, p in whole.model.named_parameters() if p.grad is not None}
    assert grads.keys() == engine.grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(engine.grads[name], g, atol=1e-6, rtol=1e-6, msg=name)

    # The check can fail: the mean of the two micro-batch losses is not the step's loss.
    naive = []
    for part, gids in ((first, groups_first), (second, groups_second)):
        b = TrainBatch.from_inputs(part, gids, pad_token_id=PAD)
        lps = whole.logprobs(b.seqs)
        naive.append(compute_policy_loss(
            lps, lps, grpo_advantages(b.rewards, b.group_ids), b.seqs.response_mask,
            policy_loss=policy_loss, loss_agg=loss_agg, max_tokens=MAX_NEW * 2,
            rollout_logprobs=b.rollout_logprobs, correction=correction,
            ref_logprobs=b.ref_logprobs, kl_coef=0.05)[0].item())
    assert abs(sum(naive) / 2 - want["loss"]) > 1e-4


async def test_the_trainer_counts_flat_groups_at_the_rewards_maximum_as_solved(
    model_dir: Path,
) -> None:
    # Four groups of 3 over two micro-batches: all at the maximum, all at 0 (flat, stuck), a
    # spread one, and one at the maximum in the second micro-batch.
    first, second = synthetic_groups([3, 3, 3], seed=4), synthetic_groups([3], seed=5)
    first["reward"] = [1.0] * 3 + [0.0] * 3 + [0.0, 0.5, 1.0]
    second["reward"] = [1.0] * 3
    engine = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")
    metrics = []
    for max_score in (1.0, None):
        role = TrainerRole(engine, TrainSettings(max_score=max_score), pad_token_id=PAD)
        await role.run(task(9, [0] * 3 + [1] * 3 + [2] * 3, stage="train",
                            params={"step": 0, "step_end": False}), first)
        end = await role.run(task(3, [3] * 3, stage="train",
                                  params={"step": 0, "step_end": True}), second)
        metrics.append(end.metrics)
    assert metrics[0]["flat_groups"] == 0.75
    assert metrics[0]["solved_groups"] == 0.5
    assert metrics[1]["flat_groups"] == 0.75
    assert "solved_groups" not in metrics[1]  # the maximum is not known


async def test_a_redone_step_drops_the_gradients_of_its_failed_attempt(model_dir: Path) -> None:
    # Attempt 0 accumulated one micro-batch, then the step was given back (another of its
    # micro-batches failed); attempt 1 redoes the step with the same groups.
    first, second = synthetic_groups([3, 3], seed=1), synthetic_groups([3], seed=2)
    gids_first, gids_second = [0, 0, 0, 1, 1, 1], [2, 2, 2]
    settings = TrainSettings(algorithm="grpo")

    async def step(engine: SpyEngine, attempts: Sequence[int]) -> None:
        role = TrainerRole(engine, settings, pad_token_id=PAD)
        for n, attempt in enumerate(attempts):
            await role.run(task(6, gids_first, stage="train",
                                params={"step": 0, "step_end": False, "attempt": attempt}), first)
            if n == len(attempts) - 1:
                await role.run(task(3, gids_second, stage="train",
                                    params={"step": 0, "step_end": True, "attempt": attempt}),
                               second)

    redone = SpyEngine(model_dir, lr=1e-3, device="cpu", dtype=torch.float64)
    await step(redone, [0, 1])
    clean = SpyEngine(model_dir, lr=1e-3, device="cpu", dtype=torch.float64)
    await step(clean, [0])
    assert redone.grads.keys() == clean.grads.keys()
    for name, g in clean.grads.items():
        torch.testing.assert_close(redone.grads[name], g, atol=1e-9, rtol=1e-9, msg=name)
    # Without the attempt the failed micro-batch would count twice: the check can fail.
    doubled = SpyEngine(model_dir, lr=1e-3, device="cpu", dtype=torch.float64)
    await step(doubled, [0, 0])
    assert any(not torch.allclose(doubled.grads[n], g) for n, g in clean.grads.items())


def mean_logprob(engine: TorchTrainerEngine, inputs: dict[str, list[Any]],
                 rows: Sequence[int]) -> float:
    batch = SequenceBatch.from_rows([inputs["prompt_ids"][r] for r in rows],
                                    [inputs["response_ids"][r] for r in rows], pad_token_id=PAD)
    lps = engine.logprobs(batch)
    return float(lps.sum() / batch.num_response_tokens)


async def test_one_grpo_step_raises_the_logprob_of_rewarded_responses(model_dir: Path) -> None:
    config = engine_config(model_dir, lr=1e-3)
    rollout = make_hf_role("rollout", config, seed=3)
    trainer = make_hf_role("train", config, seed=0)
    assert isinstance(rollout, RolloutRole)
    assert isinstance(trainer, TrainerRole)
    out = await rollout_group(rollout, 11, 8)
    rewards = [1.0, 0.0] * 4
    inputs = train_inputs(out, rewards)
    engine = trainer.engine
    assert isinstance(engine, TorchTrainerEngine)
    good, bad = [0, 2, 4, 6], [1, 3, 5, 7]
    before = mean_logprob(engine, inputs, good), mean_logprob(engine, inputs, bad)

    done = await trainer.run(task(8, [0] * 8, stage="train", params={"step": 0,
                                                                     "step_end": True}), inputs)
    after = mean_logprob(engine, inputs, good), mean_logprob(engine, inputs, bad)
    assert after[0] > before[0] + 0.01
    assert after[1] < before[1] - 0.01
    assert done.version == 1
    assert done.metrics["reward_mean"] == 0.5
    assert done.metrics["grad_norm"] > 0
    assert done.metrics["lr"] == 1e-3
    assert done.metrics["clip_frac"] == 0.0  # one update per batch: ratio 1, nothing clipped
    assert "kl" not in done.metrics
    assert "tis_mean" not in done.metrics


async def test_step_end_weights_load_into_rollout_and_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    config = engine_config(model_dir, output=tmp_path / "run", checkpoint_every=2)
    rollout = make_hf_role("rollout", config, seed=0)
    trainer = make_hf_role("train", config, seed=0)
    assert isinstance(rollout, RolloutRole)
    assert isinstance(trainer, TrainerRole)
    assert isinstance(rollout.engine, HFRolloutEngine)
    assert isinstance(trainer.engine, TorchTrainerEngine)
    inputs = train_inputs(await rollout_group(rollout, 2, 4), [1.0, 0.0, 0.0, 1.0])

    await trainer.load_version(4, {})  # resume at version 4
    done = await trainer.run(task(4, [0] * 4, stage="train",
                                  params={"step": 4, "step_end": True}), inputs)
    assert done.version == 5
    assert done.weights is not None
    assert not (tmp_path / "run").exists()  # 5 is not a multiple of 2

    assert not params_equal(rollout.engine.model, trainer.engine.model)
    await rollout.load_version(5, done.weights)
    assert params_equal(rollout.engine.model, trainer.engine.model)
    assert rollout.engine.version == 5
    assert (await rollout_group(rollout, 2, 2)).version == 5

    # Its own version coming back through the broadcast changes nothing.
    await trainer.load_version(5, done.weights)
    assert trainer.version == 5
    done = await trainer.run(task(4, [0] * 4, stage="train",
                                  params={"step": 5, "step_end": True}), inputs)
    assert done.version == 6
    ckpt = tmp_path / "run" / "step_6"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "optimizer.safetensors",
                 "trainer_state.json"):
        assert (ckpt / name).is_file(), name
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["step_6"]
    saved = load_causal_lm(ckpt, device=torch.device("cpu"), dtype=torch.float32)
    assert params_equal(saved, trainer.engine.model)


def test_the_recipes_objective_reaches_the_trainer(model_dir: Path) -> None:
    config = engine_config(model_dir, algorithm={"policy_loss": "gspo", "correction": "mis",
                                                  "mask_bounds": (0.25, 4.0)})
    role = make_hf_role("train", config, seed=0)
    assert isinstance(role, TrainerRole)
    s = role.settings
    assert (s.policy_loss, s.clip_low, s.clip_high, s.loss_agg) == (
        "gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    assert (s.correction, s.mask_bounds) == ("mis", (0.25, 4.0))
    assert s.max_score is None
    config["reward"]["max_score"] = 1.0  # `reward.max_score`, as `RewardConfig.spec` says it
    scored = make_hf_role("train", config, seed=0)
    assert isinstance(scored, TrainerRole)
    assert scored.settings.max_score == 1.0
    # Given bounds hold at any staleness; the default ("auto") only while rows may be stale.
    assert s.correction_at(0) == RolloutCorrection("mis", bounds=(0.25, 4.0))
    auto = TrainSettings(correction="icepop", mask_bounds="auto")
    assert auto.correction_at(0) is None
    assert auto.correction_at(2) == RolloutCorrection("icepop", bounds=(0.5, 2.0))
    assert TrainSettings(correction="seq_tis", tis_cap="auto").correction_at(1) == (
        RolloutCorrection("seq_tis", cap=2.0))
    with pytest.raises(ValueError, match="max_staleness"):
        auto.correction_at(None)
    with pytest.raises(ValueError, match=r"algorithm\.mask_bounds"):
        TrainSettings(correction="mis", mask_bounds=(2.0, 3.0))
    with pytest.raises(ValueError, match=r"algorithm\.policy_loss"):
        TrainSettings(policy_loss="ppo")  # type: ignore[arg-type]


def test_factory_rejects_what_it_cannot_serve(model_dir: Path, tmp_path: Path) -> None:
    config = engine_config(model_dir)
    with pytest.raises(ValueError, match="no hf role"):
        make_hf_role("value", config, seed=0)
    with pytest.raises(ValueError, match=r"model\.path"):
        make_hf_role("train", {**config, "model": {"path": str(tmp_path)}}, seed=0)


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
async def test_every_estimator_takes_a_step(model_dir: Path, algorithm: AdvantageName) -> None:
    engine = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    role = TrainerRole(engine, TrainSettings(algorithm=algorithm), pad_token_id=PAD)
    inputs = synthetic_groups([3, 3], seed=5)
    done = await role.run(task(6, [0, 0, 0, 1, 1, 1], stage="train",
                               params={"step": 0, "step_end": True}), inputs)
    assert done.version == 1
    assert math.isfinite(done.metrics["loss"])
    assert done.metrics["grad_norm"] > 0
    assert not params_equal_to(engine.model, before)


def params_equal_to(model: torch.nn.Module, state: Mapping[str, Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


async def test_a_failed_checkpoint_does_not_undo_the_step(model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    settings = TrainSettings(output=blocker, checkpoint_every=1)
    role = TrainerRole(TorchTrainerEngine(model_dir, lr=1e-3, device="cpu"), settings,
                       pad_token_id=PAD)
    done = await role.run(task(3, [0, 0, 0], stage="train",
                               params={"step": 0, "step_end": True}),
                          synthetic_groups([3], seed=6))
    assert done.version == 1
    assert done.weights is not None
    assert done.metrics["checkpoint_failed"] == 1.0


async def test_the_last_step_writes_the_final_model_also_without_checkpoints(
    model_dir: Path, tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    role = TrainerRole(TorchTrainerEngine(model_dir, lr=1e-3, device="cpu"),
                       TrainSettings(output=out, checkpoint_every=0, steps=2), pad_token_id=PAD)
    inputs = synthetic_groups([3], seed=6)
    first = await role.run(task(3, [0, 0, 0], stage="train",
                                params={"step": 0, "step_end": True}), inputs)
    assert "final_saved" not in first.metrics
    assert not out.exists()
    last = await role.run(task(3, [0, 0, 0], stage="train",
                               params={"step": 1, "step_end": True}), inputs)
    assert last.version == 2
    assert last.metrics["final_saved"] == 1.0
    # A model, loadable as one, with its tokenizer; no optimizer state, no checkpoint.
    assert sorted(p.name for p in out.iterdir()) == ["final"]
    final = out / "final"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).is_file(), name
    assert not (final / "optimizer.safetensors").exists()
    # What the launcher's progress line says of the save.
    assert last.metrics["final_bytes"] == sum(p.stat().st_size for p in final.iterdir())
    assert last.metrics["final_s"] > 0
    assert "checkpoint_s" not in last.metrics
    saved = load_causal_lm(final, device=torch.device("cpu"), dtype=torch.float32)
    assert params_equal(saved, role.engine.model)

    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    role = TrainerRole(TorchTrainerEngine(model_dir, lr=1e-3, device="cpu"),
                       TrainSettings(output=blocked, steps=1), pad_token_id=PAD)
    done = await role.run(task(3, [0, 0, 0], stage="train",
                               params={"step": 0, "step_end": True}), inputs)
    assert done.version == 1  # the step stands; the run says no final model was saved
    assert done.metrics["final_save_failed"] == 1.0
    assert "final_saved" not in done.metrics


async def test_a_trainer_joining_a_run_continues_its_learning_rate_schedule(
    model_dir: Path,
) -> None:
    engine = TorchTrainerEngine(model_dir, lr=1e-3, warmup_steps=10, device="cpu")
    trainer = TrainerRole(engine, TrainSettings(), pad_token_id=0)
    # A restarted trainer joins at the run's version 5 with its weights: the warm-up goes on
    # from step 5 instead of starting over.
    await trainer.load_version(5, engine.export_weights())
    assert (trainer.version, engine.step) == (5, 5)
    assert engine.lr_at(engine.step) == pytest.approx(1e-3 * 6 / 10)
    # A resume at a version (no weights: the checkpoint's optimizer state has its own step)
    # leaves the schedule alone.
    other = TorchTrainerEngine(model_dir, lr=1e-3, warmup_steps=10, device="cpu")
    await TrainerRole(other, TrainSettings(), pad_token_id=0).load_version(5, {})
    assert other.step == 0


async def test_the_stability_guards_orders_keep_restore_and_scale_the_rate(
    model_dir: Path,
) -> None:
    engine = TorchTrainerEngine(model_dir, lr=1e-3, device="cpu")
    role = TrainerRole(engine, TrainSettings(), pad_token_id=PAD)
    inputs = synthetic_groups([3, 3], seed=7)

    async def step(n: int, **orders: Any) -> RoleOutput:
        return await role.run(task(6, [0, 0, 0, 1, 1, 1], stage="train",
                                   params={"step": n, "step_end": True, **orders}), inputs)

    await step(0)
    version_1 = engine.whole_state()
    kept = await step(1, keep_from=1)  # keeps version 1 at the start of step 1
    assert kept.metrics["kept_version"] == 1
    await step(2, keep_from=1)  # the same order again: no new copy
    assert role.orders.kept_version == 1
    assert not params_equal_to(engine.model, version_1)
    # A rollback restores version 1 at the start of the step; at a rate of 0 the step then
    # leaves the weights there. The schedule keeps its place.
    back = await step(3, keep_from=1, rollback={"id": 1, "version": 1}, lr_scale=0.0)
    assert back.metrics["lr"] == 0.0
    assert params_equal_to(engine.model, version_1)
    assert engine.step == 4  # 3 steps, the restored copy of step 1, and this one
    # Each rollback order is carried out once; the rate scale follows the order in force.
    again = await step(4, keep_from=1, rollback={"id": 1, "version": 1}, lr_scale=0.5)
    assert again.metrics["lr"] == pytest.approx(0.5 * engine.lr_at(4))
    assert not params_equal_to(engine.model, version_1)
