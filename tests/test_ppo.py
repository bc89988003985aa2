"""PPO end to end: the critic's GAE targets, its learning, the recipe, and real runs.

The critic and the short real run use a tiny Qwen2 model built into a temporary directory; the
simulated and real runs go through a real `Controller` (worker processes, sockets, shared memory).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from flowrl.controller import Controller
from flowrl.recipe import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RolloutConfig,
    SimConfig,
    TrainerConfig,
)
from flowrl.recipe_file import RecipeError, load_recipe
from flowrl.tiny_model import build_tiny_model
from flowrl.worker_spec import engine_spec
from workers.engines.protocols import SequenceBatch
from workers.engines.value_model import ValueModelEngine
from workers.roles.critic import (
    CRITIC_DIR,
    CriticRole,
    CriticSettings,
    critic_checkpoint,
    critic_targets,
)
from workers.roles.factory import make_hf_role
from workers.roles.trainer import TrainSettings

PAD = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ppo") / "tiny", hidden=32, layers=1,
                            heads=2, kv_heads=1, vocab_size=300, max_positions=64)


def rows(seed: int, lengths: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (3,), generator=gen) for _ in lengths]
    responses = [torch.randint(3, 250, (n,), generator=gen) for n in lengths]
    return prompts, responses


# ---- GAE targets ---------------------------------------------------------------------------------


def test_gae_advantages_and_returns_match_a_hand_computed_example() -> None:
    # Row 0: three tokens, reward 1 on the last. Row 1: two tokens (one padding), reward 0.
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, -0.2, 9.9]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = critic_targets(torch.tensor([1.0, 0.0]), values, mask, gamma=0.9, lam=0.5)
    # δ_t = r_t + γ·V_{t+1} − V_t; A_t = δ_t + γλ·A_{t+1}; R = A + V.
    # Row 0: δ = (−0.32, 0.16, 0.6) → A = (−0.32 + 0.45·0.43, 0.16 + 0.45·0.6, 0.6).
    # Row 1: δ = (0.9·−0.2 − 0.1, 0.2) = (−0.28, 0.2) → A = (−0.28 + 0.45·0.2, 0.2).
    expected_adv = torch.tensor([[-0.1265, 0.43, 0.6], [-0.19, 0.2, 0.0]])
    expected_ret = torch.tensor([[0.3735, 0.63, 1.0], [-0.09, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


def test_the_critic_role_returns_aligned_targets(model_dir: Path) -> None:
    engine = ValueModelEngine(model_dir, lr=1e-3, device="cpu", seed=3)
    role = CriticRole(engine, CriticSettings(rows_per_step=8, gamma=0.9, lam=0.5),
                      pad_token_id=PAD)
    prompts, responses = rows(0, [4, 1, 3])
    rewards = [1.0, -0.5, 0.25]
    out = role.learn(prompts, responses, rewards)
    values, adv, ret = (out.fields[k] for k in ("values", "advantages", "returns"))
    assert [v.numel() for v in values] == [4, 1, 3]
    assert all(v.dtype == torch.float32 for v in [*values, *adv, *ret])
    # The role's values are the engine's; its targets are GAE over them, row by row.
    seqs = SequenceBatch.from_rows(prompts, responses, pad_token_id=PAD)
    scored = seqs.response_values(engine.values(seqs))
    for i, (v, a, r, reward) in enumerate(zip(values, adv, ret, rewards, strict=True)):
        torch.testing.assert_close(v, scored[i])
        mask = torch.ones(1, v.numel(), dtype=torch.bool)
        want_a, want_r = critic_targets(torch.tensor([reward]), v[None], mask, gamma=0.9,
                                        lam=0.5)
        torch.testing.assert_close(a, want_a[0])
        torch.testing.assert_close(r, want_r[0])
        torch.testing.assert_close(a[-1], reward - v[-1])  # the last token: r − V
    assert engine.step == 0  # 3 of 8 rows: no step yet


# ---- the critic learns ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_one_critic_step_lowers_its_value_loss_on_a_fixed_batch(model_dir: Path) -> None:
    engine = ValueModelEngine(model_dir, lr=3e-3, device="cpu", seed=0)
    # γ = λ = 1: every token's return is the row's reward whatever the values, a fixed target.
    role = CriticRole(engine, CriticSettings(rows_per_step=4, gamma=1.0, lam=1.0),
                      pad_token_id=PAD)
    prompts, responses = rows(1, [3, 5, 2, 4])
    rewards = [1.0, 0.0, 2.0, -1.0]
    seqs = SequenceBatch.from_rows(prompts, responses, pad_token_id=PAD)
    target = torch.tensor(rewards)[:, None].expand(seqs.response_mask.shape)

    def loss() -> float:
        v = engine.values(seqs)
        return float(0.5 * (v - target)[seqs.response_mask].square().mean())

    before = loss()
    first = role.learn(prompts[:2], responses[:2], rewards[:2])
    assert engine.step == 0
    assert "critic_step" not in first.metrics
    torch.testing.assert_close(first.fields["returns"][1], torch.zeros(5))
    second = role.learn(prompts[2:], responses[2:], rewards[2:])
    assert engine.step == 1
    assert second.metrics["critic_step"] == 1.0
    # The step's loss is the token mean over both micro-batches, measured before the step.
    assert second.metrics["critic_loss"] == pytest.approx(before, rel=1e-4)
    after = loss()
    assert after < before
    assert math.isfinite(second.metrics["critic_grad_norm"])


@pytest.mark.timeout(30)
def test_replay_epochs_take_a_step_each_with_the_clipped_loss(model_dir: Path) -> None:
    engine = ValueModelEngine(model_dir, lr=3e-3, device="cpu", seed=0)
    role = CriticRole(engine, CriticSettings(rows_per_step=2, gamma=1.0, lam=1.0, epochs=3,
                                             value_clip=0.01), pad_token_id=PAD)
    prompts, responses = rows(2, [3, 4])
    out = role.learn(prompts, responses, [1.0, -1.0])
    assert engine.step == 3
    assert out.metrics["critic_step"] == 3.0
    assert math.isfinite(out.metrics["critic_loss"])


def _critic_state(engine: ValueModelEngine) -> dict[str, torch.Tensor]:
    opt = engine.optimizer.state
    return {**{f"w/{k}": v.clone() for k, v in engine.model.state_dict().items()},
            **{f"m/{n}": opt[p]["exp_avg"].clone() for n, p in engine.model.named_parameters()}}


@pytest.mark.timeout(60)
def test_a_resumed_run_starts_its_critic_from_the_last_save(
    model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    settings = CriticSettings(rows_per_step=2, gamma=1.0, lam=1.0, output=out, checkpoint_every=2,
                              run_id="run-1")
    engine = ValueModelEngine(model_dir, lr=3e-3, device="cpu", seed=0)
    role = CriticRole(engine, settings, pad_token_id=PAD)
    prompts, responses = rows(3, [3, 4])
    role.learn(prompts, responses, [1.0, -1.0])
    assert critic_checkpoint(out) is None  # one step: not due yet
    role.learn(prompts, responses, [0.5, 0.0])
    assert critic_checkpoint(out) == out / CRITIC_DIR
    saved = _critic_state(engine)
    # A save cut short between its two renames leaves the previous one to be found.
    (out / CRITIC_DIR).rename(out / ".critic.old")
    assert critic_checkpoint(out) == out / ".critic.old"
    (out / ".critic.old").rename(out / CRITIC_DIR)

    # What `flowrl.launch --resume out` hands the critic worker (`flowrl.run.compile_recipe`).
    r = Recipe(steps=4, model=ModelConfig(path=str(model_dir)),
               algorithm=AlgorithmConfig(name="ppo", group_size=1),
               critic=CriticConfig(lr=3e-3, gamma=1.0, lam=1.0),
               trainer=TrainerConfig(groups_per_step=2), output=out, checkpoint_every=2)
    config = dict(r.to_pipeline().engine_config)
    shutil.copytree(model_dir, out / "step_2")  # stands for the policy checkpoint
    config["model"] = {**config["model"], "path": str(out / "step_2"),
                       "reference_path": str(model_dir)}
    config["resume"] = {"checkpoint": str(out / "step_2"), "version": 2}
    resumed = make_hf_role("critic", config, seed=5)  # another seed: another head, unless loaded
    assert isinstance(resumed, CriticRole)
    assert resumed.steps == 2
    got = _critic_state(resumed.engine)
    assert all(torch.equal(got[k], saved[k]) for k in saved)
    # Both go on identically: the optimizer's moments came back too.
    a = role.learn(prompts, responses, [1.0, 1.0]).metrics
    b = resumed.learn(prompts, responses, [1.0, 1.0]).metrics
    assert a["critic_step"] == b["critic_step"] == 3.0
    assert a["critic_loss"] == pytest.approx(b["critic_loss"], rel=1e-6)
    after = _critic_state(resumed.engine)
    assert all(torch.allclose(after[k], v, atol=1e-7) for k, v in _critic_state(engine).items())

    # Without a critic save a resumed critic starts afresh (and says so in the log).
    config["resume"] = {"checkpoint": str(tmp_path / "elsewhere" / "step_2"), "version": 2}
    fresh = make_hf_role("critic", config, seed=5)
    assert isinstance(fresh, CriticRole)
    assert fresh.steps == 0

    # A critic process restarted within the run starts from the run's save; another run
    # writing to the same directory never loads it.
    config["resume"] = None
    config["model"] = {**config["model"], "path": str(model_dir), "reference_path": None}
    restarted = make_hf_role("critic", config, seed=5, run_id="run-1")
    assert isinstance(restarted, CriticRole)
    assert restarted.steps == 2  # the last save (every 2 critic steps; step 3 made none)
    assert all(torch.equal(_critic_state(restarted.engine)[k], saved[k]) for k in saved)
    other = make_hf_role("critic", config, seed=5, run_id="run-2")
    assert isinstance(other, CriticRole)
    assert other.steps == 0



# ---- recipe --------------------------------------------------------------------------------------


def test_a_ppo_recipe_validates_and_compiles_with_a_critic_stage() -> None:
    r = Recipe(steps=2, algorithm=AlgorithmConfig(name="ppo", group_size=1, kl_coef=0.01),
               critic=CriticConfig(lr=1e-4, gamma=0.99, lam=0.9))
    spec = r.to_pipeline()
    graph = spec.graph()
    assert [s.name for s in graph.order] == ["rollout", "reward", "reference", "critic", "train"]
    assert set(graph.stage("critic").produces) == {"values", "advantages", "returns"}
    assert "advantages" in graph.stage("train").needs
    assert {p.role: p.count for p in spec.pools}["critic"] == 1
    critic = CriticSettings.from_spec(engine_spec(spec.engine_config))
    assert (critic.gamma, critic.lam, critic.rows_per_step) == (0.99, 0.9, 8)
    assert TrainSettings.from_spec(engine_spec(spec.engine_config)).algorithm == "ppo"
    # Without PPO there is no critic, and critic settings are refused.
    assert "critic" not in [s.name for s in Recipe(steps=1).to_pipeline().stages]
    assert Recipe(steps=1).to_pipeline().engine_config["critic"] is None


def test_critic_settings_without_ppo_name_their_field(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text("from flowrl.recipe import Recipe, CriticConfig\n"
                    "recipe = Recipe(steps=1, critic=CriticConfig(lr=1e-3))\n")
    with pytest.raises(RecipeError) as excinfo:
        load_recipe(path)
    assert "critic" in dict(excinfo.value.problems)


# ---- runs ----------------------------------------------------------------------------------------


FAST_SIM = SimConfig(prompt_len=8, log_mean=2.0, log_sigma=0.5, rollout_base_s=0.001,
                     rollout_token_s=0.0001, train_token_s=0.00001, train_step_s=0.002,
                     critic_token_s=0.00001, weight_numel=256)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_a_simulated_ppo_pipeline_runs_through_a_controller() -> None:
    r = Recipe(steps=3, algorithm=AlgorithmConfig(name="ppo", group_size=1),
               rollout=RolloutConfig(engine="sim", workers=2, max_new_tokens=32),
               trainer=TrainerConfig(groups_per_step=4, micro_batch_groups=2), sim=FAST_SIM,
               max_staleness=1)
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=r.steps, timeout_s=30)
    assert out["version"] == 3
    assert out["samples"] == 3 * 4
    assert out["rows_trained_twice"] == 0  # every trained row passed the critic: train needs
    # its advantages, so the graph dispatches no train task before the critic has written them


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_short_real_ppo_run_completes(model_dir: Path) -> None:
    r = Recipe(
        steps=2, model=ModelConfig(path=str(model_dir)),
        data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(name="ppo", group_size=2),
        critic=CriticConfig(lr=1e-3),
        rollout=RolloutConfig(max_new_tokens=4),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=r.steps, timeout_s=75)
        status = ctl.status()
    assert out["version"] == 2
    assert out["samples"] == 2 * 2 * 2
    assert out["rows_trained_twice"] == 0
    assert status["errors"] == []
    assert all(math.isfinite(s["train_loss"]) for s in ctl.step_log)
    # The critic's step figures reach the step log: a step's rows need the critic's targets,
    # so by its commit the critic has stepped on at least one batch.
    assert all(s["critic_step"] >= 1 and math.isfinite(s["critic_loss"]) for s in ctl.step_log)
