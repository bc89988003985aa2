"""Episodes: multi-turn agent loops as coroutines, batched by the engine, stored token-exactly.

A real tiny Qwen2 model behind the continuous batcher runs the episodes; the trainer's engine
recomputes their logprobs from the stored trajectories; the algorithms train masked multi-turn
rows; a short real run trains a toy episode."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from flowrl.algorithms import compute_policy_loss, grpo_advantages
from flowrl.algorithms.corrections import RolloutCorrection
from flowrl.chat_render import ChatRenderer
from flowrl.data import Example, arithmetic
from flowrl.episode import (
    INSERTED_VERSION,
    EpisodeError,
    Generated,
    Policy,
    Turn,
    resolve_episode_fn,
    run_episode,
)
from flowrl.pipeline import EPISODE_FIELDS
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.recipe.inputs import InputError, check_inputs
from flowrl.reward_fn import RewardFnError
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import HFRolloutEngine, SamplingParams, SequenceBatch, TorchTrainerEngine
from workers.engines.hf_continuous import ContinuousBatcher
from workers.roles.episode_rollout import EpisodeFailed, EpisodeRolloutRole, trajectory_fields
from workers.roles.factory import load_tokenizer
from workers.roles.trainer import TrainBatch, TrainerRole, TrainSettings

set_threads(1)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("episodes") / "tiny", hidden=32, layers=2,
                            heads=2, kv_heads=1, vocab_size=300, max_positions=128)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


# Each run of `three_turns` appends what it saw, so a test can compare the stored rows with
# the turns and insertions the episode itself got and made.
SEEN: list[dict[str, Any]] = []
INSERTED_IDS = [5, 6, 7]


async def three_turns(policy: Policy, example: Example) -> None:
    """Three turns with text, token ids and raw ids inserted between them."""
    policy.add(example.prompt)
    t1 = await policy.generate(max_new_tokens=5)
    inserted_text = policy.add(" so 7\n")
    t2 = await policy.generate(token_ids=INSERTED_IDS, max_new_tokens=4)
    inserted_raw = policy.add([8, 9])
    t3 = await policy.generate(max_new_tokens=3)
    SEEN.append({"turns": [t1, t2, t3],
                 "inserted": [inserted_text + INSERTED_IDS, inserted_raw]})
    policy.finish(0.25 * len(SEEN), per_turn=[0.1, 0.2, 0.3])


def _task(groups: Sequence[int], rows_per_group: int) -> tuple[dict[str, Any], dict[str, Any]]:
    row_groups = [g for g in groups for _ in range(rows_per_group)]
    task = {"task_id": 1, "row_groups": row_groups, "params": {}}
    return task, {"prompt": [3 + g for g in row_groups]}


def _role(model_dir: Path, tokenizer: Any, fn: Any = three_turns) -> EpisodeRolloutRole:
    engine = HFRolloutEngine(model_dir, device="cpu", seed=0, version=4)
    return EpisodeRolloutRole(ContinuousBatcher(engine), tokenizer, arithmetic(16),
                              SamplingParams(temperature=1.0, max_new_tokens=8), fn,
                              sample_seed=11)


async def test_a_three_turn_episode_is_stored_token_by_token(
    model_dir: Path, tokenizer: Any
) -> None:
    SEEN.clear()
    role = _role(model_dir, tokenizer)
    task, inputs = _task([0], 3)
    out = await role.run(task, inputs)  # type: ignore[arg-type]
    f = out.fields
    assert set(f) == {"prompt_ids", "response_ids", "rollout_logprobs", *EPISODE_FIELDS}
    assert len(SEEN) == 3
    assert out.version == 4
    assert out.metrics["turns"] == 9.0
    for row in range(3):
        first = f["response_ids"][row][: len(SEEN[0]["turns"][0].token_ids)].tolist()
        seen = next(s for s in SEEN if list(s["turns"][0].token_ids) == first)
        turns: list[Turn] = seen["turns"]
        # The expected layout, built from what the episode saw: turn, insert, turn, ...
        ids: list[int] = []
        mask: list[bool] = []
        lps: list[float] = []
        versions: list[int] = []
        ends: list[int] = []
        for k, turn in enumerate(turns):
            ids += turn.token_ids
            mask += [True] * len(turn.token_ids)
            lps += turn.logprobs
            versions += [4] * len(turn.token_ids)
            ends.append(len(ids))
            if k < 2:
                ins = seen["inserted"][k]
                ids += ins
                mask += [False] * len(ins)
                lps += [0.0] * len(ins)
                versions += [INSERTED_VERSION] * len(ins)
        assert f["prompt_ids"][row].tolist() == tokenizer(
            arithmetic(16).at(3).prompt, add_special_tokens=False).input_ids
        assert f["response_ids"][row].tolist() == ids
        assert f["loss_mask"][row].tolist() == mask
        assert f["rollout_logprobs"][row].tolist() == pytest.approx(lps, abs=0.0)
        assert f["token_versions"][row].tolist() == versions
        rewards = [0.0] * len(ids)
        for end, r in zip(ends, [0.1, 0.2, 0.3], strict=True):
            rewards[end - 1] = r
        assert f["token_rewards"][row].tolist() == pytest.approx(rewards)
        assert f["response_ids"][row].dtype == torch.int64
        assert f["loss_mask"][row].dtype == torch.bool
        assert f["token_versions"][row].dtype == torch.int32
    assert sorted(f["reward"]) == [0.25, 0.5, 0.75]
    # The stored sequence is the context the policy sampled from: the trainer's engine,
    # reading it, recomputes every generated token's logprob.
    trainer = TorchTrainerEngine(model_dir, device="cpu")
    seqs = SequenceBatch.from_rows(f["prompt_ids"], f["response_ids"], pad_token_id=0,
                                   loss_masks=f["loss_mask"])
    recomputed = trainer.logprobs(seqs)
    stored = seqs.per_token(f["rollout_logprobs"], "rollout_logprobs")
    assert seqs.num_response_tokens == int(out.metrics["tokens"])
    assert torch.allclose(recomputed[seqs.response_mask], stored[seqs.response_mask], atol=1e-4)


class Scripted:
    """Stands in for sampling, which cannot be made to emit a chosen non-canonical token split
    on demand: returns the given turns' ids in order and records the contexts it was asked."""

    def __init__(self, turns: Sequence[Sequence[int]]) -> None:
        self.turns = [list(t) for t in turns]
        self.contexts: list[list[int]] = []

    async def __call__(self, context: Sequence[int], *, stream_key: int,
                       max_new_tokens: int | None, stop: tuple[str, ...] | None) -> Generated:
        ids = self.turns[len(self.contexts)]
        self.contexts.append(list(context))
        return Generated(ids, [-1.5] * len(ids), [7] * len(ids), "stop")


async def test_a_turn_takes_the_recipes_budget_unless_it_gives_its_own(tokenizer: Any) -> None:
    asked: list[int | None] = []

    async def generate(context: Sequence[int], *, stream_key: int,
                       max_new_tokens: int | None, stop: tuple[str, ...] | None) -> Generated:
        asked.append(max_new_tokens)
        return Generated([9], [-1.0], [0], "stop")

    policy = Policy(generate, tokenizer, stream_seed=0, max_context=64, max_new_tokens=8)
    await policy.generate(token_ids=[3, 4, 5])
    await policy.generate(max_new_tokens=20)
    await policy.generate(token_ids=[6] * 53)  # 58 positions used: 6 left
    # The recipe's budget, a turn's own, and either cut to the model's context.
    assert asked == [8, 20, 6]


def _non_canonical(tokenizer: Any) -> list[int]:
    """Ids of a word split into single characters, which the tokenizer encodes differently."""
    for word in ("the", "and", "answer", "number", "what", "plus"):
        whole = tokenizer(word, add_special_tokens=False).input_ids
        chars = [tokenizer(c, add_special_tokens=False).input_ids for c in word]
        if all(len(c) == 1 for c in chars) and len(whole) < len(word):
            return [c[0] for c in chars]
    raise AssertionError("the tokenizer merges none of the words")


async def test_decode_then_encode_drift_cannot_change_a_trained_token(tokenizer: Any) -> None:
    tokenizer.chat_template = CHATML
    try:
        split = _non_canonical(tokenizer)
        # The drift is real: decoding these ids and encoding the text gives other ids.
        assert tokenizer(tokenizer.decode(split), add_special_tokens=False).input_ids != split
        eos = tokenizer.eos_token_id
        engine = Scripted([[*split, eos], [*split, *split, eos]])
        policy = Policy(engine, tokenizer, stream_seed=1)
        await policy.generate([{"role": "user", "content": "say it"}])
        turn = await policy.generate([{"role": "tool", "content": "again"}])
        policy.finish(1.0)
    finally:
        tokenizer.chat_template = None
    t = policy.trajectory
    assert turn.token_ids == (*split, *split, eos)
    # The second request's context holds the first turn's ids as sampled.
    assert engine.contexts[1][len(t.prompt_ids): len(t.prompt_ids) + len(split) + 1] == [
        *split, eos]
    fields = trajectory_fields([t])
    batch = TrainBatch.from_inputs(fields, [0], pad_token_id=0)
    trained = batch.seqs.input_ids[batch.seqs.response_mask].tolist()
    assert trained == [*split, eos, *split, *split, eos]
    assert batch.rollout_logprobs[batch.seqs.response_mask].tolist() == [-1.5] * len(trained)


def test_chat_messages_continue_a_trajectory_as_the_template_renders_them(
    tokenizer: Any
) -> None:
    tokenizer.chat_template = CHATML
    try:
        chat = ChatRenderer(tokenizer)
        conversation = [{"role": "user", "content": "2+3"}]
        prompt = chat.prompt(conversation)
        # The policy generated "5" and stopped on its end-of-turn token.
        generated = [*tokenizer("5", add_special_tokens=False).input_ids,
                     tokenizer.eos_token_id]
        tool = [{"role": "tool", "content": "checked"}]
        glue = chat.continuation(tool, after_turn_text=tokenizer.eos_token,
                                 generation_prompt=True)
        full = tokenizer.apply_chat_template(
            [*conversation, {"role": "assistant", "content": "5"}, *tool], tokenize=False,
            add_generation_prompt=True)
        assert tokenizer.decode([*prompt, *generated, *glue]) == full
        # A turn cut at its length owes the whole end-of-turn marker.
        cut = chat.continuation(tool, after_turn_text="", generation_prompt=False)
        assert tokenizer.decode(cut).startswith(tokenizer.eos_token + "\n<|im_start|>tool")
    finally:
        tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(tokenizer).prompt(conversation)


async def test_concurrent_episodes_share_decode_forwards_and_sample_as_alone(
    model_dir: Path, tokenizer: Any
) -> None:
    role = _role(model_dir, tokenizer)
    task, inputs = _task([0, 1, 2], 2)
    together = await role.run(task, inputs)  # type: ignore[arg-type]
    assert role.batcher.stats.mean_rows > 1.0
    assert together.metrics["batch_rows_mean"] > 1.0
    # The group at position 4 alone samples exactly what it sampled among the others.
    alone_task, alone_inputs = _task([1], 2)
    alone = await _role(model_dir, tokenizer).run(alone_task, alone_inputs)  # type: ignore[arg-type]
    for j in range(2):
        for name in ("response_ids", "loss_mask"):
            assert torch.equal(together.fields[name][2 + j], alone.fields[name][j])
        assert torch.allclose(together.fields["rollout_logprobs"][2 + j],
                              alone.fields["rollout_logprobs"][j], atol=1e-5)


def _multi_turn_inputs(tokenizer: Any) -> tuple[dict[str, Any], list[int]]:
    """Two groups of two scripted trajectories, inserted tokens between turns."""

    def row(turns: list[list[int]], inserted: list[int], reward: float) -> Any:
        async def ep(policy: Policy, example: Any) -> float:
            policy.add([3, 4, 5])
            await policy.generate()
            policy.add(inserted)
            await policy.generate()
            return reward

        policy = Policy(Scripted(turns), tokenizer, stream_seed=0)
        return asyncio.run(run_episode(ep, policy, None))

    trajectories = [row([[10, 11], [12, 13, 14]], [20, 21], 1.0),
                    row([[15], [16]], [22], 0.0),
                    row([[10, 12, 14], [11]], [23, 24, 25], 0.5),
                    row([[17, 18], [19]], [26], 0.5)]
    return trajectory_fields(trajectories), [0, 0, 1, 1]


def test_group_advantages_and_every_policy_loss_train_only_the_policys_tokens(
    tokenizer: Any
) -> None:
    fields, groups = _multi_turn_inputs(tokenizer)
    batch = TrainBatch.from_inputs(fields, groups, pad_token_id=0)
    mask = batch.seqs.response_mask
    span = batch.seqs.span
    assert int(mask.sum()) == sum(int(m.sum()) for m in fields["loss_mask"])
    assert bool((span & ~mask).any())  # inserted tokens: in the span, out of the loss
    # Group-relative over episodes as over completions: episode rewards, per group.
    adv = grpo_advantages(batch.rewards, batch.group_ids)
    assert adv[0] > 0 > adv[1]
    assert adv[2] == adv[3] == 0
    for policy_loss in ("ppo_clip", "gspo", "cispo"):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            for correction in (None, RolloutCorrection("tis", cap=2.0)):
                lps = (batch.rollout_logprobs - 0.1).requires_grad_(True)
                loss, _ = compute_policy_loss(
                    lps, lps.detach() + 0.05, adv, mask, policy_loss=policy_loss,  # type: ignore[arg-type]
                    loss_agg=agg, max_tokens=8, rollout_logprobs=batch.rollout_logprobs,  # type: ignore[arg-type]
                    correction=correction, ref_logprobs=batch.rollout_logprobs, kl_coef=0.1)
                loss.backward()
                assert lps.grad is not None
                assert math.isfinite(float(loss.detach()))
                assert not bool(lps.grad[~mask].any()), (policy_loss, agg)
                assert bool(lps.grad[mask].any())


def test_every_estimator_trains_masked_multi_turn_rows(model_dir: Path, tokenizer: Any) -> None:
    fields, groups = _multi_turn_inputs(tokenizer)
    generated = sum(int(m.sum()) for m in fields["loss_mask"])
    for algorithm in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        engine = TorchTrainerEngine(model_dir, device="cpu")
        role = TrainerRole(engine, TrainSettings(algorithm=algorithm), pad_token_id=0,  # type: ignore[arg-type]
                           version=2)
        batch = TrainBatch.from_inputs(fields, groups, pad_token_id=0)
        metrics = role.accumulate(batch, None)
        assert metrics["tokens"] == generated
        out = role.finish_step()
        assert math.isfinite(out.metrics["loss"])
        assert out.metrics["token_staleness"] == 2.0 - 7.0  # scripted tokens say version 7


def test_the_critic_values_and_credits_the_policys_tokens(model_dir: Path, tokenizer: Any) -> None:
    from workers.engines.value_model import ValueModelEngine
    from workers.roles.critic import CriticRole, CriticSettings

    fields, _ = _multi_turn_inputs(tokenizer)
    role = CriticRole(ValueModelEngine(model_dir, lr=1e-3, device="cpu", seed=0),
                      CriticSettings(rows_per_step=8), pad_token_id=0)
    out = role.learn(fields["prompt_ids"], fields["response_ids"], fields["reward"],
                     loss_masks=fields["loss_mask"], token_rewards=fields["token_rewards"])
    for name in ("values", "advantages", "returns"):
        for value, ids, mask in zip(out.fields[name], fields["response_ids"],
                                    fields["loss_mask"], strict=True):
            assert value.shape == ids.shape  # aligned with response_ids, as every field
            assert not bool(value[~mask].any())
            assert bool(value[mask].any())


async def test_an_episode_that_breaks_the_rules_or_raises_fails_its_task(
    model_dir: Path, tokenizer: Any
) -> None:
    async def no_reward(policy: Policy, example: Example) -> None:
        policy.add(example.prompt)
        await policy.generate(max_new_tokens=2)

    async def raises(policy: Policy, example: Example) -> None:
        raise KeyError("the environment is gone")

    task, inputs = _task([0], 2)
    with pytest.raises(ExceptionGroup) as info:
        await _role(model_dir, tokenizer, no_reward).run(task, inputs)  # type: ignore[arg-type]
    err = info.value.exceptions[0]
    assert isinstance(err, EpisodeFailed)
    assert "without a reward" in str(err)
    with pytest.raises(ExceptionGroup) as info:
        await _role(model_dir, tokenizer, raises).run(task, inputs)  # type: ignore[arg-type]
    assert "KeyError: 'the environment is gone'" in str(info.value.exceptions[0])
    policy = Policy(Scripted([[1]]), tokenizer, stream_seed=0)
    with pytest.raises(EpisodeError, match="nothing to generate"):
        await policy.generate()


EPISODE_FILE = '''
async def count_up(policy, example):
    policy.add(example.prompt)
    first = await policy.generate(max_new_tokens=3)
    policy.add(" then")
    second = await policy.generate(max_new_tokens=3)
    return float(len(second.token_ids) == 3) * 0.5 + float(len(first.token_ids) < 3) * 0.5

def not_async(policy, example):
    return 1.0
'''


def test_the_recipe_names_an_episode(tmp_path: Path) -> None:
    path = tmp_path / "episodes.py"
    path.write_text(EPISODE_FILE)
    r = Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:count_up"))
    assert r.roles == ("rollout", "train")
    stages = {s.name: s for s in r.to_pipeline().stages}
    assert set(stages) == {"rollout", "train"}
    assert {"loss_mask", "token_versions", "reward"} <= set(stages["train"].needs)
    assert r.engine_spec().rollout.episode == f"{path}:count_up"
    on_vllm = Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:count_up", engine="vllm"))
    assert on_vllm.engine_spec().rollout.episode == f"{path}:count_up"
    with pytest.raises(ValidationError, match=r"rollout\.episode: episodes run on a real engine"):
        Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:count_up", engine="sim"))
    with pytest.raises(ValidationError, match="an episode scores itself"):
        Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:count_up"), reward=RewardConfig())
    with pytest.raises(ValidationError, match="no such file"):
        Recipe(steps=1, rollout=RolloutConfig(episode=f"{tmp_path / 'none.py'}:count_up"))
    with pytest.raises(InputError, match=r"rollout\.episode: .* not an async function"):
        check_inputs(Recipe(steps=1, rollout=RolloutConfig(episode=f"{path}:not_async")))
    with pytest.raises(RewardFnError, match=r"episode function .* has no 'missing'"):
        resolve_episode_fn(f"{path}:missing")


def test_an_episode_run_refuses_evaluation_and_the_chat_template_naming_field_and_file(
    tmp_path: Path,
) -> None:
    """An episode renders its own chat messages: the prompt encoding and the held-out rounds
    (single completions) do not apply to it."""
    from flowrl.recipe_file import RecipeError, load_recipe

    (tmp_path / "episodes.py").write_text(EPISODE_FILE)
    recipe_file = tmp_path / "episode_recipe.py"
    recipe_file.write_text(
        "from flowrl.recipe import Recipe, RolloutConfig\n"
        f"recipe = Recipe(steps=1, rollout=RolloutConfig(episode={str(tmp_path)!r} + "
        "'/episodes.py:count_up'))\n")
    assert load_recipe(recipe_file).rollout.episode is not None
    for sets, field in ((["eval.every=2", "eval.prompts=4"], "eval"),
                        (["data.chat_template=true"], r"data\.chat_template"),
                        (["data.chat_template=true", "data.system_prompt=Be brief."],
                         r"data\.chat_template")):
        with pytest.raises(RecipeError, match=(
                rf"episode_recipe\.py.*{field}: not used with rollout\.episode "
                r"'.*episodes\.py:count_up': an episode renders its own chat messages")):
            load_recipe(recipe_file, sets)


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_run_trains_a_multi_turn_episode(tmp_path: Path) -> None:
    from flowrl.controller import Controller

    (tmp_path / "episodes.py").write_text(EPISODE_FILE)
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    steps = 2
    r = Recipe(
        steps=steps, model=ModelConfig(path=str(model)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=4),
        rollout=RolloutConfig(episode=f"{tmp_path / 'episodes.py'}:count_up", groups_per_task=2,
                              max_new_tokens=8),
        trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
    )
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=90)
    assert out["version"] == steps
    assert out["rows_trained_twice"] == 0
    assert len(ctl.step_log) == steps
    for entry in ctl.step_log:
        assert math.isfinite(entry["train_loss"])
        assert entry["train_token_staleness"] == 0.0  # synchronous: every token on-policy
        assert 0 < entry["train_tokens"] <= 2 * 4 * 6
