"""Episodes on vLLM (`workers.engines.vllm_continuous.VLLMBatcher`): multi-turn trajectories
with tools, the OpenAI-compatible endpoint, and weights swapped while requests run.

Runs only where vLLM is installed (``make test-vllm``); shares the suite's one engine
(`conftest.py`), and every test that loads other weights puts the original ones back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip("vllm", minversion="0.32")
    openai = pytest.importorskip("openai")

import torch

from flowrl.data import Example, arithmetic
from flowrl.episode import Policy
from workers.engines import SamplingParams, SequenceBatch, TorchTrainerEngine
from workers.engines.vllm_continuous import VLLMBatcher
from workers.engines.vllm_rollout import VLLMRolloutEngine
from workers.roles.episode_rollout import EpisodeRolloutRole
from workers.roles.factory import load_tokenizer
from workers.tool_pool import ToolPool

ROOT = Path(__file__).resolve().parents[2]
PAD = 1
#: the shared engine's version (`conftest.py`)
VERSION = 3
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_versions")
# vLLM's and the trainer's float32 logprobs of the same tokens differ by <= 1e-6 (measured).
LOGPROB_TOL = 1e-4
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)
#: each turn's budget, given per turn: without it a turn may fill the model's context
TURN = 6


def _role(engine: VLLMRolloutEngine, model_dir: Path, fn: Any, *, endpoint: bool = False,
          tools: ToolPool | None = None) -> EpisodeRolloutRole:
    tokenizer = load_tokenizer(model_dir)
    tokenizer.chat_template = CHATML
    return EpisodeRolloutRole(VLLMBatcher(engine), tokenizer, arithmetic(16), SAMPLING, fn,
                              sample_seed=5, endpoint=endpoint, tools=tools)


async def _run(role: EpisodeRolloutRole, rows: int = 2) -> dict[str, list[Any]]:
    task = {"task_id": 1, "row_groups": [0] * rows, "params": {}}
    try:
        out = await role.run(task, {"prompt": [2] * rows})  # type: ignore[arg-type]
    finally:
        await role.aclose()
    return out.fields


def _trainer_logprobs(trainer: TorchTrainerEngine, prompts: list[list[int]],
                      responses: list[list[int]]) -> list[torch.Tensor]:
    batch = SequenceBatch.from_rows(prompts, responses, pad_token_id=PAD)
    return batch.response_values(trainer.logprobs(batch, temperature=1.0))


async def with_a_tool(policy: Policy, example: Example) -> float:
    await policy.generate([{"role": "user", "content": example.prompt}], max_new_tokens=TURN)
    result = await policy.call_tool("add", a=2, b=3)
    await policy.generate([{"role": "tool", "content": result.text}], max_new_tokens=TURN)
    return 1.0 if result.ok and result.text == "5" else 0.0


async def test_a_multi_turn_episode_with_a_tool_result_is_recorded_token_exactly(
    engine: VLLMRolloutEngine, model_dir: Path, trainer: TorchTrainerEngine, tmp_path: Path
) -> None:
    (tmp_path / "tools.py").write_text("def add(a, b):\n    return a + b\n")
    tools = ToolPool({"add": f"{tmp_path / 'tools.py'}:add"}, workers=1)
    fields = await _run(_role(engine, model_dir, with_a_tool, tools=tools))
    assert fields["reward"] == [1.0, 1.0]
    tokenizer = load_tokenizer(model_dir)
    expected = _trainer_logprobs(trainer, [p.tolist() for p in fields["prompt_ids"]],
                                 [r.tolist() for r in fields["response_ids"]])
    for row, ids in enumerate(fields["response_ids"]):
        mask, versions = fields["loss_mask"][row], fields["token_versions"][row]
        logprobs = fields["rollout_logprobs"][row]
        assert mask.shape == versions.shape == logprobs.shape == ids.shape
        # generated, the tool message inserted (never trained), generated again
        runs = [bool(mask[0])] + [bool(b) for a, b in itertools.pairwise(mask)
                                  if bool(a) != bool(b)]
        assert runs == [True, False, True], mask.tolist()
        assert "tool\n5" in tokenizer.decode(ids[~mask].tolist())
        assert set(versions[mask].tolist()) == {VERSION}
        assert set(versions[~mask].tolist()) == {-1}
        assert bool((logprobs[~mask] == 0).all())
        # Every generated token's logprob is the trainer's over the stored trajectory: what
        # vLLM saw is exactly what is stored, token for token.
        assert torch.allclose(logprobs[mask], expected[row][mask], atol=LOGPROB_TOL, rtol=0)


TOOL = {"role": "tool", "content": "the calculator says 9"}


async def chat_direct(policy: Policy, example: Example) -> float:
    await policy.generate([{"role": "user", "content": example.prompt}], max_new_tokens=TURN)
    second = await policy.generate([TOOL], max_new_tokens=TURN)
    return float(len(second.token_ids))


async def chat_openai(policy: Policy, example: Example) -> float:
    async with policy.openai_client() as client:
        messages: list[Any] = [{"role": "user", "content": example.prompt}]
        first = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=TURN)
        messages += [first.choices[0].message, TOOL]
        second = await client.chat.completions.create(model="policy", messages=messages,
                                                      max_tokens=TURN)
        assert second.object == "chat.completion"
        return float(second.usage.completion_tokens)


async def completions_direct(policy: Policy, example: Example) -> float:
    policy.add(example.prompt)
    first = await policy.generate(max_new_tokens=3)
    policy.add(" then")
    last = await policy.generate(max_new_tokens=3)
    return float(len(first.token_ids) + len(last.token_ids))


async def completions_openai(policy: Policy, example: Example) -> float:
    async with policy.openai_client() as client:
        first = await client.completions.create(model="p", prompt=example.prompt, max_tokens=3)
        text = example.prompt + first.choices[0].text + " then"
        last = await client.completions.create(model="p", prompt=text, max_tokens=3)
        assert last.object == "text_completion"
        return float(first.usage.completion_tokens + last.usage.completion_tokens)


@pytest.mark.parametrize(("direct", "served"), [(chat_direct, chat_openai),
                                                (completions_direct, completions_openai)],
                         ids=["chat", "completions"])
async def test_the_openai_client_drives_episodes_on_vllm_token_exactly(
    engine: VLLMRolloutEngine, model_dir: Path, direct: Any, served: Any
) -> None:
    a = await _run(_role(engine, model_dir, direct))
    b = await _run(_role(engine, model_dir, served, endpoint=True))
    for name in FIELDS:
        for row, (x, y) in enumerate(zip(a[name], b[name], strict=True)):
            same = (torch.allclose(x, y, atol=1e-5) if name == "rollout_logprobs"
                    else torch.equal(x, y))
            assert same, (name, row)
    assert a["reward"] == b["reward"]
    assert all(bool(m.any()) for m in b["loss_mask"])


async def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.002)


CONTEXTS = [[18, 19, 12, 24, 30], [21, 22, 11, 20, 30, 18, 20, 22], [40, 41, 42]]
LONG = SamplingParams(temperature=1.0, max_new_tokens=24)


@pytest.mark.usefixtures("restore")
@pytest.mark.parametrize("rebuild_kv", [False, True], ids=["keep-kv", "rebuild-kv"])
async def test_weights_swap_mid_generation_and_every_sequence_continues(
    engine: VLLMRolloutEngine, trainer: TorchTrainerEngine, other_dir: Path,
    other_weights: dict[str, torch.Tensor], rebuild_kv: bool
) -> None:
    batcher = VLLMBatcher(engine)

    def run_all() -> list[asyncio.Task[Any]]:
        return [asyncio.create_task(batcher.generate(c, LONG, stream_key=k))
                for k, c in enumerate(CONTEXTS)]

    uninterrupted = await asyncio.gather(*run_all())
    tasks = run_all()
    forwards = batcher.stats.forwards
    await _wait_for(lambda: batcher.stats.forwards >= forwards + 4)
    continued = await batcher.swap(lambda: engine.load_weights(other_weights, VERSION + 1),
                                   rebuild_kv=rebuild_kv)
    gens = await asyncio.gather(*tasks)
    assert continued == sum(
        VERSION + 1 in g.token_versions.tolist() for g in gens) > 0
    assert batcher.stats.interruptions == 1
    old = _trainer_logprobs(trainer, CONTEXTS, [g.response_ids.tolist() for g in gens])
    new = _trainer_logprobs(TorchTrainerEngine(other_dir, device="cpu"), CONTEXTS,
                            [g.response_ids.tolist() for g in gens])
    for g, before, lp_old, lp_new in zip(gens, uninterrupted, old, new, strict=True):
        versions = g.token_versions.tolist()
        k = versions.count(VERSION)
        assert k >= 4
        assert versions == [VERSION] * k + [VERSION + 1] * (len(versions) - k)
        if k == len(versions):
            continue  # ended before the swap
        # Never restarted: the tokens before the swap are the uninterrupted run's.
        assert g.response_ids[:k].tolist() == before.response_ids[:k].tolist()
        assert g.finish_reason == "stop" or len(g.response_ids) == LONG.max_new_tokens
        assert torch.allclose(g.logprobs[:k], lp_old[:k], atol=LOGPROB_TOL, rtol=0)
        after, full_new = g.logprobs[k:], lp_new[k:]
        if rebuild_kv:  # the kept tokens' KV recomputed: exactly the new policy's
            assert torch.allclose(after, full_new, atol=LOGPROB_TOL, rtol=0)
        else:  # new weights over the old weights' KV: neither policy's logprobs exactly
            assert not torch.allclose(after, full_new, atol=LOGPROB_TOL, rtol=0)
            assert not torch.allclose(after, lp_old[k:], atol=LOGPROB_TOL, rtol=0)


async def test_a_batched_request_samples_what_the_engine_samples_with_its_seed(
    engine: VLLMRolloutEngine, model_dir: Path
) -> None:
    """Stop strings included: the token completing one ends the response and is kept."""
    tokenizer = load_tokenizer(model_dir)
    batcher = VLLMBatcher(engine)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=("e",))
    keys = list(range(100, 108))
    batched = await asyncio.gather(*(batcher.generate(CONTEXTS[0], params, stream_key=k)
                                     for k in keys))
    alone = engine.generate([CONTEXTS[0]] * len(keys),
                            SamplingParams(temperature=1.0, max_new_tokens=24, stop=("e",),
                                           prompt_seeds=keys))
    assert [g.response_ids.tolist() for g in batched] == [
        g.response_ids.tolist() for g in alone]
    stopped = [g for g in batched if g.finish_reason == "stop"]
    assert stopped, "no response produced an 'e' in 24 tokens"
    for g in stopped:
        ids = g.response_ids.tolist()
        assert "e" in tokenizer.decode(ids)
        assert "e" not in tokenizer.decode(ids[:-1])


async def test_more_prompt_tokens_than_a_step_prefills_arrive_at_once(
    engine: VLLMRolloutEngine
) -> None:
    """16 seeded requests of 300 tokens: more than a step's 4096 prefill tokens on CPU."""
    batcher = VLLMBatcher(engine)
    short = SamplingParams(temperature=1.0, max_new_tokens=2)
    gens = await asyncio.gather(*(
        batcher.generate([(7 * i + j) % 250 + 3 for j in range(300)], short, stream_key=i)
        for i in range(16)))
    assert all(1 <= len(g.response_ids) <= 2 for g in gens)


@pytest.mark.usefixtures("restore")
def test_a_reload_is_not_served_from_blocks_the_old_weights_cached(
    engine: VLLMRolloutEngine, other_weights: dict[str, torch.Tensor]
) -> None:
    """vLLM's prefix cache keeps KV blocks by their tokens; a prompt longer than a block seen
    before a reload must be computed again with the new weights."""
    prompt = [[(7 * i) % 250 + 3 for i in range(300)]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine.generate(prompt, greedy)  # fills the cache under the old weights
    engine.load_weights(other_weights, VERSION + 1)
    after = engine.generate(prompt, greedy)[0]
    engine.llm.reset_prefix_cache()
    fresh = engine.generate(prompt, greedy)[0]
    assert after.response_ids.tolist() == fresh.response_ids.tolist()
    assert torch.allclose(after.logprobs, fresh.logprobs, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_of_an_agent_recipe_with_rollout_on_vllm(tmp_path: Path) -> None:
    """Two steps of the OpenAI-client agent recipe on vLLM, interruptible: episodes through the
    endpoint, weights from the trainer each step."""
    steps = 2
    done = subprocess.run(
        [sys.executable, "-m", "flowrl.launch", "recipes/openai_agent.py", "--steps",
         str(steps), "--no-monitor", "--output", str(tmp_path / "run"),
         "--set", "rollout.engine=vllm", "--set", "rollout.partial=true",
         "--set", "model.tiny.pretrain_steps=0", "--set", "trainer.groups_per_step=2",
         "--set", "trainer.micro_batch_groups=1", "--set", "algorithm.group_size=4"],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"),
             "FLOWRL_LOG_FORMAT": "json"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("step ") for line in lines) == steps, done.stdout
    summary = json.loads(lines[-2])
    assert summary["version"] == steps
    assert summary["samples"] == steps * 2 * 4
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == list(range(1, steps + 1)) or len(log) == steps
    assert all(math.isfinite(e["train_loss"]) for e in log)
