"""The multi-turn tool recipe (recipes/tool_cpu.py): its warm start teaches the very tokens its
episode produces, and a test-sized run calls the tool and trains only the policy's tokens.

That the recipe learns is shown by ``bench/tool_learning.py`` (README, "Multi-turn episodes").
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from flowrl.data import Example
from flowrl.episode import Generated, Policy, ToolResult, resolve_episode_fn
from flowrl.recipe import ModelConfig, Recipe
from flowrl.recipe_file import load_recipe
from flowrl.reward_fn import resolve_reward_fn
from flowrl.tiny_model import EOS_TOKEN, build_tiny_model, synthetic_corpus, tool_call_line
from workers.roles.factory import load_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tool_cpu.py"
SMALL = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "corpus_kind": "tool_calls"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(str(build_tiny_model(tmp_path_factory.mktemp("tool") / "m", **SMALL)))


def test_the_corpus_teaches_the_format_half_calls_and_random_direct_answers() -> None:
    lines = synthetic_corpus(0, kind="tool_calls")
    calls = [line for line in lines if "CALL" in line]
    assert 0.45 < len(calls) / len(lines) < 0.55
    direct = [line.split("=") for line in lines if "CALL" not in line]
    right = sum(eval(question) == int(answer) for question, answer in direct)
    assert right / len(direct) < 0.03  # a direct answer is right by chance only
    assert tool_call_line(random.Random(1), call_share=1.0) == (
        f"17+72= CALL add 17 72{EOS_TOKEN}\ntool: 89\n89")


async def _replay(tokenizer: Any, line: str, answer: str) -> Policy:
    """Run the recipe's episode on an engine that continues the warm start's encoding of
    ``line`` turn by turn (to its next end-of-text), so the episode's trajectory can be held
    against it. A scripted engine, not the model: what is checked is the tokenization."""
    encoded = [*tokenizer(line).input_ids, tokenizer.eos_token_id]
    eos = tokenizer.eos_token_id

    async def engine(context: Sequence[int], *, stream_key: int, max_new_tokens: int | None,
                     stop: tuple[str, ...] | None) -> Generated:
        assert list(context) == encoded[:len(context)], "the episode left the warm start's ids"
        end = encoded.index(eos, len(context)) + 1
        ids = encoded[len(context):end]
        return Generated(ids, [0.0] * len(ids), [0] * len(ids), "stop")

    add = resolve_reward_fn(f"{RECIPE}:add", what="tool")

    async def tools(name: str, args: dict[str, Any]) -> ToolResult:
        # The sandbox pool is the slow test's; here only the text it returns matters.
        return ToolResult(ok=True, text=json.dumps(add(**args)))

    policy = Policy(engine, tokenizer, stream_seed=0, tools=tools, max_turns=2)
    reward = await resolve_episode_fn(f"{RECIPE}:episode")(policy, Example("37+45=", answer))
    assert policy.trajectory.context == encoded
    policy.finish(reward)
    return policy


async def test_the_episode_holds_exactly_the_tokens_the_warm_start_trains(tokenizer: Any) -> None:
    called = await _replay(tokenizer, f"37+45= CALL add 37 45{EOS_TOKEN}\ntool: 82\n82", "82")
    t = called.trajectory
    assert (t.reward, t.turns, called.tool_calls) == (1.0, 2, 1)
    inserted = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if not m]
    assert tokenizer.decode(inserted) == "\ntool: 82\n"  # the tool's message, never trained
    generated = [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m]
    assert tokenizer.decode(generated) == f" CALL add 37 45{EOS_TOKEN}82{EOS_TOKEN}"
    direct = await _replay(tokenizer, "37+45=113", "82")
    assert (direct.trajectory.reward, direct.trajectory.turns, direct.tool_calls) == (0.0, 1, 0)
    wrong_call = await _replay(tokenizer, f"37+45= CALL add 37 44{EOS_TOKEN}\ntool: 81\n81", "82")
    assert (wrong_call.trajectory.reward, wrong_call.tool_calls) == (0.0, 1)


@pytest.mark.slow
@pytest.mark.timeout(150)
async def test_a_test_sized_run_of_the_recipe_calls_the_tool_and_masks_its_results(
    tmp_path: Path,
) -> None:
    from flowrl.controller import Controller
    from flowrl.run import compile_recipe

    # A smaller warm start than the recipe's: enough to call (with operands not yet right).
    model = build_tiny_model(tmp_path / "tiny", pretrain_steps=100, **SMALL)
    steps = 2
    loaded = load_recipe(RECIPE, [
        f"steps={steps}", "max_staleness=0", f"output={tmp_path / 'run'}",
        "trainer.groups_per_step=2", "trainer.micro_batch_groups=2", "rollout.groups_per_task=1"])
    given = {name: getattr(loaded, name) for name in loaded.model_fields_set}
    recipe = Recipe(**{**given, "model": ModelConfig(path=str(model))})
    assert recipe.rollout.tool_refs == {"add": f"{RECIPE}:add"}
    async with Controller(compile_recipe(recipe)) as ctl:
        out = await ctl.run(steps=steps, timeout_s=120)
    assert out["version"] == steps
    assert out["rows_trained_twice"] == 0
    calls = 0.0
    for e in ctl.step_log:
        assert math.isfinite(e["train_loss"])
        assert e["rollout_tool_errors_raised"] == 0
        assert e["rollout_tool_errors_unknown"] == 0
        # Synchronous: a step's tool calls are its episodes'. Each call inserts the tool's
        # message, at least six tokens ("\ntool: 7\n"), none of them trained.
        response_tokens = e["response_length_mean"] * e["samples"]
        assert e["train_tokens"] <= response_tokens - 6 * e["rollout_tool_calls"] + 1e-6
        calls += e["rollout_tool_calls"]
    assert calls > 0
