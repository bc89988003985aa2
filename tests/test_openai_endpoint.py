"""The OpenAI-compatible endpoint: the real ``openai`` client drives episodes of a real tiny model.

Token exactness is checked against the same episode written directly against the policy handle:
each turn samples from a stream keyed by the episode and the turn, so both must store the very
same trajectory, token by token."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from flowrl.data import Example, arithmetic
from flowrl.episode import EpisodeError, Policy
from flowrl.recipe import ModelConfig, Recipe, RolloutConfig
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import HFRolloutEngine, SamplingParams
from workers.engines.hf_continuous import ContinuousBatcher
from workers.openai_endpoint import OpenAIEndpoint
from workers.roles.episode_rollout import EpisodeRolloutRole
from workers.roles.factory import load_tokenizer

openai = pytest.importorskip("openai")

set_threads(1)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "openai_agent.py"
FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_versions")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("endpoint") / "tiny", hidden=32, layers=1,
                            heads=2, kv_heads=1, vocab_size=300, max_positions=512)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    tok = load_tokenizer(model_dir)
    tok.chat_template = CHATML
    return tok


def _role(model_dir: Path, tokenizer: Any, fn: Any, *, endpoint: bool) -> EpisodeRolloutRole:
    engine = HFRolloutEngine(model_dir, device="cpu", seed=0, version=3)
    return EpisodeRolloutRole(ContinuousBatcher(engine), tokenizer, arithmetic(16),
                              SamplingParams(temperature=1.0, max_new_tokens=6), fn,
                              sample_seed=5, endpoint=endpoint)


async def _run(role: EpisodeRolloutRole, rows: int = 2) -> dict[str, list[Any]]:
    task = {"task_id": 1, "row_groups": [0] * rows, "params": {}}
    try:
        out = await role.run(task, {"prompt": [2] * rows})  # type: ignore[arg-type]
    finally:
        await role.aclose()
    return out.fields


def _same_trajectories(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> None:
    for name in FIELDS:
        for row, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            # Logprobs differ in the last bits with what shares the engine's batch.
            same = (torch.allclose(x, y, atol=1e-5) if name == "rollout_logprobs"
                    else torch.equal(x, y))
            assert same, (name, row)
    assert a["reward"] == b["reward"]


TOOL = {"role": "tool", "content": "the calculator says 9"}
REPLIES: list[str] = []


async def chat_direct(policy: Policy, example: Example) -> float:
    first = await policy.generate([{"role": "user", "content": example.prompt}])
    second = await policy.generate([TOOL])
    REPLIES.append(first.text + "|" + second.text)
    return float(len(second.token_ids))


async def chat_openai(policy: Policy, example: Example) -> float:
    client = policy.openai_client()
    messages: list[Any] = [{"role": "user", "content": example.prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    # The reply object goes back as it came, as agent code appends it.
    messages += [first.choices[0].message, TOOL]
    second = await client.chat.completions.create(model="policy", messages=messages)
    assert first.object == "chat.completion"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens == len(policy.token_ids) - second.usage.completion_tokens
    REPLIES.append(first.choices[0].message.content + "|" + second.choices[0].message.content)
    await client.close()
    return float(second.usage.completion_tokens)


async def test_chat_turns_through_the_openai_client_are_recorded_token_exactly(
    model_dir: Path, tokenizer: Any
) -> None:
    REPLIES.clear()
    direct = await _run(_role(model_dir, tokenizer, chat_direct, endpoint=False))
    served = await _run(_role(model_dir, tokenizer, chat_openai, endpoint=True))
    _same_trajectories(served, direct)
    # The replies are the decoded turns; the tool message is inserted, out of the loss.
    assert REPLIES[2:] == REPLIES[:2]
    for mask, versions in zip(served["loss_mask"], served["token_versions"], strict=True):
        assert bool(mask.any())
        assert bool((~mask).any())
        assert set(versions[mask].tolist()) == {3}
        assert set(versions[~mask].tolist()) == {-1}


async def completions_direct(policy: Policy, example: Example) -> float:
    policy.add(example.prompt)
    first = await policy.generate(max_new_tokens=3)
    policy.add(" then")
    await policy.generate(max_new_tokens=3)
    policy.add([7, 8])
    last = await policy.generate(max_new_tokens=2)
    return float(len(first.token_ids) + len(last.token_ids))


async def completions_openai(policy: Policy, example: Example) -> float:
    async with openai.AsyncOpenAI(base_url=policy.openai_base_url, api_key=policy.api_key,
                                  max_retries=0) as client:
        first = await client.completions.create(model="p", prompt=example.prompt, max_tokens=3)
        text = example.prompt + first.choices[0].text + " then"
        second = await client.completions.create(model="p", prompt=text, max_tokens=3)
        assert second.object == "text_completion"
        # Token ids continue the trajectory itself.
        ids = [*policy.token_ids, 7, 8]
        last = await client.completions.create(model="p", prompt=ids, max_tokens=2)
        return float(first.usage.completion_tokens + last.usage.completion_tokens)


async def test_completions_continue_the_recorded_text_or_token_ids(
    model_dir: Path, tokenizer: Any
) -> None:
    direct = await _run(_role(model_dir, tokenizer, completions_direct, endpoint=False))
    served = await _run(_role(model_dir, tokenizer, completions_openai, endpoint=True))
    _same_trajectories(served, direct)


async def test_keys_history_and_sampling_are_checked(model_dir: Path, tokenizer: Any) -> None:
    role = _role(model_dir, tokenizer, chat_direct, endpoint=False)
    endpoint = OpenAIEndpoint(temperature=1.0)
    await endpoint.start()
    mine, other = role._policy(2, 0), role._policy(2, 1)
    mine.endpoint, other.endpoint = endpoint.open(mine), endpoint.open(other)
    client = mine.openai_client()
    intruder = openai.AsyncOpenAI(base_url=mine.openai_base_url, api_key=other.api_key,
                                  max_retries=0)
    chat = client.chat.completions
    user = [{"role": "user", "content": "2+7="}]
    try:
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            await intruder.chat.completions.create(model="p", messages=user)
        for kwargs, what in (({"stream": True}, "stream=true is not supported"),
                             ({"n": 2}, "n must be 1"),
                             ({"temperature": 0.5}, "trainer scores the tokens"),
                             ({"tools": []}, "unsupported parameter")):
            with pytest.raises(openai.BadRequestError, match=what):
                await chat.create(model="p", messages=user, **kwargs)
        assert mine.token_ids == []  # nothing refused reached the trajectory
        first = await chat.create(model="p", messages=user, temperature=1.0, max_tokens=3)
        reply = first.choices[0].message.content
        recorded = list(mine.token_ids)
        edited = [*user, {"role": "assistant", "content": reply + " (edited)"},
                  {"role": "user", "content": "sure?"}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[1\] differs"):
            await chat.create(model="p", messages=edited)
        with pytest.raises(openai.BadRequestError, match="through the chat API"):
            await client.completions.create(model="p", prompt="2+7=")
        assert mine.token_ids == recorded
        assert other.token_ids == []  # the intruder's own episode is untouched too
        endpoint.close(mine.endpoint)
        with pytest.raises(openai.AuthenticationError):  # a finished episode's key
            await chat.create(model="p", messages=[*user, {"role": "user", "content": "x"}])
    finally:
        await client.close()
        await intruder.close()
        await endpoint.aclose()


def test_the_endpoint_serves_episodes_only(tokenizer: Any) -> None:
    with pytest.raises(ValidationError, match=r"rollout\.endpoint: the endpoint serves episodes"):
        Recipe(steps=1, rollout=RolloutConfig(endpoint=True))
    policy = Policy(lambda *a, **k: None, tokenizer, stream_seed=0)  # type: ignore[arg-type,return-value]
    with pytest.raises(EpisodeError, match=r"rollout\.endpoint = true"):
        policy.openai_client()


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_the_openai_agent_recipe_trains(tmp_path: Path) -> None:
    from flowrl.controller import Controller
    from flowrl.recipe_file import load_recipe

    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    steps = 2
    r = load_recipe(RECIPE, [
        f"steps={steps}", "algorithm.group_size=4", "trainer.groups_per_step=2",
        "trainer.micro_batch_groups=1"])
    r = r.model_copy(update={"model": ModelConfig(path=str(model))})  # not the pretrained one
    async with Controller(r.to_pipeline()) as ctl:
        out = await ctl.run(steps=steps, timeout_s=120)
    assert out["version"] == steps
    assert out["rows_trained_twice"] == 0
    for entry in ctl.step_log:
        assert math.isfinite(entry["train_loss"])
        assert entry["train_tokens"] > 0
