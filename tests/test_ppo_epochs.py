"""PPO epochs and mini-batches (several optimizer updates per step over π_old kept once), and
the KL to the reference in the rewards instead of the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_roles import PAD, synthetic_groups, task
from torch import Tensor

from flowrl.algorithms import gae_advantages
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.tiny_model import build_tiny_model
from workers.engines import TorchTrainerEngine
from workers.engines.protocols import SequenceBatch
from workers.roles.critic import CriticSettings, critic_targets
from workers.roles.policy_updates import mini_batch_runs
from workers.roles.trainer import TrainBatch, TrainerRole, TrainSettings, advantages

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ppo_epochs") / "tiny", vocab_size=300)


class RecordingEngine(TorchTrainerEngine):
    """Records each optimizer update (whether it advanced the schedule) and the gradients the
    last one saw."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates: list[bool] = []
        self.grads: dict[str, Tensor] = {}

    def optimizer_step(self, *, advance: bool = True) -> dict[str, float]:
        self.updates.append(advance)
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}
        return super().optimizer_step(advance=advance)


def engine(model_dir: Path) -> RecordingEngine:
    return RecordingEngine(model_dir, lr=0.05, device="cpu", dtype=torch.float64)


def step_tasks(parts: list[dict[str, list[Any]]]) -> list[tuple[Any, dict[str, list[Any]]]]:
    """One train task per part (each one group), the last ending step 0."""
    out = []
    for i, part in enumerate(parts):
        rows = len(part["reward"])
        out.append((task(rows, [i] * rows, stage="train",
                         params={"step": 0, "step_end": i == len(parts) - 1}), part))
    return out


def test_mini_batch_runs() -> None:
    assert mini_batch_runs([3, 3, 3, 3], 2) == [slice(0, 2), slice(2, 4)]
    assert mini_batch_runs([3, 3, 3, 3], 4) == [slice(i, i + 1) for i in range(4)]
    assert mini_batch_runs([3, 3, 3, 3], 1) == [slice(0, 4)]
    assert mini_batch_runs([4, 4], 4) == [slice(0, 1), slice(1, 2)]  # fewer micro-batches
    assert mini_batch_runs([6, 2, 2, 2], 2) == [slice(0, 1), slice(1, 4)]  # by rows
    with pytest.raises(ValueError, match="parts"):
        mini_batch_runs([1], 0)


async def test_epochs_and_mini_batches_take_their_updates_and_clip(model_dir: Path) -> None:
    parts = [synthetic_groups([3], seed=s) for s in range(4)]
    eng = engine(model_dir)
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    role = TrainerRole(eng, TrainSettings(ppo_epochs=2, mini_batches=2), pad_token_id=PAD)
    *mids, last = step_tasks(parts)
    for t, inputs in mids:
        await role.run(t, inputs)
    # Micro-batches are kept, not trained, until the step's end.
    assert eng.updates == []
    assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
    end = await role.run(*last)
    # Two passes of two mini-batches: four updates, the schedule advanced by the last only.
    assert eng.updates == [False, False, False, True]
    assert end.metrics["updates"] == 4.0
    assert eng.step == 1
    assert end.version == 1
    # π_old is kept from before the first update: later updates see ratios away from 1.
    assert end.metrics["clip_frac"] > 0.0

    # One update per step (the default) never clips: its ratio is 1.
    single = TrainerRole(engine(model_dir), TrainSettings(), pad_token_id=PAD)
    for t, inputs in step_tasks(parts):
        out = await single.run(t, inputs)
    assert out.metrics["clip_frac"] == 0.0
    assert "updates" not in out.metrics


async def test_the_loss_of_two_epochs_matches_a_hand_computation(model_dir: Path) -> None:
    inputs = synthetic_groups([3], seed=5)
    eng = engine(model_dir)
    role = TrainerRole(eng, TrainSettings(ppo_epochs=2), pad_token_id=PAD)
    end = await role.run(task(3, [0, 0, 0], stage="train",
                              params={"step": 0, "step_end": True}), inputs)

    # By hand: π_old before any update, GRPO advantages, PPO's clipped surrogate (ε = 0.2)
    # averaged over the response tokens, two updates on the same batch.
    batch = TrainBatch.from_inputs(inputs, [0, 0, 0], pad_token_id=PAD)
    mask = batch.seqs.response_mask
    r = batch.rewards  # float32, as the trainer takes them
    adv = ((r - r.mean()) / (r.std() + 1e-6)).double()[:, None].expand(mask.shape)
    hand = engine(model_dir)
    old = hand.logprobs(batch.seqs)
    losses, clipped = [], []

    def loss_fn(lps: Tensor, seqs: SequenceBatch) -> Tensor:
        ratio = torch.exp(lps - old)
        terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        with torch.no_grad():
            losses.append(float(terms[mask].mean()))
            clipped.append(float(((-adv * ratio.clamp(0.8, 1.2)) > -adv * ratio)[mask].double()
                                 .mean()))
        return terms[mask].mean()

    for advance in (False, True):
        hand.train_micro_batch(batch.seqs, loss_fn)
        hand.optimizer_step(advance=advance)
    assert clipped[0] == 0.0
    assert clipped[1] > 0.0
    assert end.metrics["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6, abs=1e-9)
    # The second pass's loss and clip fraction are taken after the first update: they agree
    # only if that update was the same.
    assert end.metrics["clip_frac"] == pytest.approx(sum(clipped) / 2, abs=1e-6)


# ---- the KL in the rewards ----------------------------------------------------------------------


def test_kl_in_the_rewards_changes_group_advantages_as_by_hand(model_dir: Path) -> None:
    inputs = synthetic_groups([4], seed=3)
    batch = TrainBatch.from_inputs(inputs, [0] * 4, pad_token_id=PAD)
    assert batch.ref_logprobs is not None
    old = TorchTrainerEngine(model_dir, device="cpu").logprobs(batch.seqs)
    got = advantages("grpo", batch, old_logprobs=old, kl_coef=0.1, kl_estimator="k1")
    mask = batch.seqs.response_mask
    kl = [float((old[i] - batch.ref_logprobs[i])[mask[i]].sum()) for i in range(4)]
    r = [float(x) - 0.1 * k for x, k in zip(batch.rewards, kl, strict=True)]
    mean = sum(r) / 4
    std = (sum((x - mean) ** 2 for x in r) / 3) ** 0.5
    want = torch.tensor([(x - mean) / (std + 1e-6) for x in r])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, advantages("grpo", batch))


async def test_kl_in_the_rewards_trains_as_the_penalised_rewards_without_a_kl_loss(
    model_dir: Path,
) -> None:
    first, second = synthetic_groups([3], seed=1), synthetic_groups([3], seed=2)
    gids = [0, 0, 0]
    in_reward = engine(model_dir)
    role = TrainerRole(in_reward, TrainSettings(kl_coef=0.5, kl_estimator="k1",
                                                kl_in_reward=True), pad_token_id=PAD)
    await role.run(task(3, gids, stage="train", params={"step": 0}), first)
    end = await role.run(task(3, [1, 1, 1], stage="train",
                              params={"step": 0, "step_end": True}), second)

    # The same step with the rewards penalised by hand and no KL anywhere else.
    scorer = engine(model_dir)
    penalised, kls = [], []
    for part in (first, second):
        b = TrainBatch.from_inputs(part, gids, pad_token_id=PAD)
        assert b.ref_logprobs is not None
        kl = (scorer.logprobs(b.seqs) - b.ref_logprobs).masked_fill(~b.seqs.response_mask, 0.0)
        kls.append(kl[b.seqs.response_mask])
        penalised.append({**part, "reward": (b.rewards.double() - 0.5 * kl.sum(-1)).tolist()})
    plain = engine(model_dir)
    ref_role = TrainerRole(plain, TrainSettings(), pad_token_id=PAD)
    await ref_role.run(task(3, gids, stage="train", params={"step": 0}), penalised[0])
    want = await ref_role.run(task(3, [1, 1, 1], stage="train",
                                   params={"step": 0, "step_end": True}), penalised[1])
    assert end.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-6, abs=1e-9)
    for name, g in plain.grads.items():
        torch.testing.assert_close(in_reward.grads[name], g, rtol=1e-6, atol=1e-9, msg=name)
    # "kl" is the mean per-token KL the rewards were charged.
    assert end.metrics["kl"] == pytest.approx(float(torch.cat(kls).mean()), rel=1e-6)


def test_the_critic_puts_the_kl_in_its_token_rewards() -> None:
    mask = torch.tensor([[False, True, True, True]])
    values = torch.tensor([[0.0, 0.5, 0.25, 0.125]])
    kl = torch.tensor([[0.0, 0.2, -0.1, 0.4]])
    adv, ret = critic_targets(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0, kl=kl,
                              kl_coef=0.5)
    # γ = λ = 1: the return of token t is the sum of the rewards from t on.
    rewards = [-0.5 * 0.2, -0.5 * -0.1, 1.0 - 0.5 * 0.4]
    want_ret = torch.tensor([[0.0, sum(rewards), sum(rewards[1:]), rewards[2]]])
    torch.testing.assert_close(ret, want_ret)
    torch.testing.assert_close(adv, (want_ret - values).masked_fill(~mask, 0.0))
    plain, _ = gae_advantages(torch.tensor([[0.0, 0.0, 0.0, 1.0]]), values, mask, gamma=1.0,
                              lam=1.0, whiten=False)
    assert not torch.allclose(adv, plain)


# ---- the recipe -------------------------------------------------------------------------------


def write(tmp_path: Path, args: str) -> Path:
    path = tmp_path / "recipe.py"
    path.write_text("from flowrl.recipe import *\n"
                    f"recipe = Recipe(steps=1, {args})\n")
    return path


@pytest.mark.parametrize(("args", "field", "says"), [
    ("trainer=TrainerConfig(groups_per_step=8, mini_batch_groups=3)",
     "trainer.mini_batch_groups", "does not divide groups_per_step=8"),
    ("trainer=TrainerConfig(groups_per_step=6, micro_batch_groups=2, mini_batch_groups=3)",
     "trainer.mini_batch_groups", "not a multiple of micro_batch_groups=2"),
    ("trainer=TrainerConfig(groups_per_step=4, ranks=2, ppo_epochs=2)",
     "trainer.ppo_epochs", "need ranks=1"),
    ("algorithm=AlgorithmConfig(kl_in_reward=True)",
     "algorithm.kl_in_reward", "set kl_coef > 0"),
])
def test_recipe_rules(tmp_path: Path, args: str, field: str, says: str) -> None:
    with pytest.raises(RecipeError) as ei:
        load_recipe(write(tmp_path, args))
    problems = dict(ei.value.problems)
    assert field in problems, str(ei.value)
    assert says in problems[field]


def test_the_recipe_reaches_the_workers(tmp_path: Path) -> None:
    r = load_recipe(write(tmp_path, (
        "algorithm=AlgorithmConfig(name='ppo', kl_coef=0.1, kl_in_reward=True), "
        "trainer=TrainerConfig(groups_per_step=8, micro_batch_groups=2, mini_batch_groups=4, "
        "ppo_epochs=3)")))
    spec = r.engine_spec()
    settings = TrainSettings.from_spec(spec)
    assert (settings.ppo_epochs, settings.mini_batches, settings.kl_in_reward) == (3, 2, True)
    assert settings.kl_loss_coef == 0.0
    critic = CriticSettings.from_spec(spec)
    assert (critic.kl_coef, critic.kl_estimator) == (0.1, "k3")
    graph = r.to_pipeline().graph()
    assert {"rollout_logprobs", "ref_logprobs"} <= set(graph.stage("critic").needs)
    order = [s.name for s in graph.order]
    assert order.index("reference") < order.index("critic")
    # The KL as a loss term leaves the critic's rewards alone.
    loss = load_recipe(write(tmp_path, "algorithm=AlgorithmConfig(name='ppo', kl_coef=0.1)"))
    assert CriticSettings.from_spec(loss.engine_spec()).kl_coef == 0.0
    assert "ref_logprobs" not in loss.to_pipeline().graph().stage("critic").needs
