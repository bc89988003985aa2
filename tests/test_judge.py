"""The generative judge: verdict parsing, templates, and a real model's verdicts served by the
rollout engine code, with unparsable verdicts scored by the default and counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flowrl import messages as m
from flowrl.recipe import DataConfig, JudgeConfig, ModelConfig, Recipe, RewardConfig
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines import HFRolloutEngine
from workers.roles.factory import make_hf_role
from workers.roles.judge import Judge, fill_template, parse_verdict
from workers.roles.reward_role import RewardRole
from workers.roles.reward_runner import RewardResult, RewardRunner, RewardSample

set_threads(1)

TINY: dict[str, Any] = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1,
                        "max_positions": 128}
TEMPLATE = "Rate the answer to {prompt} from 0 to 10.\nAnswer: {response}"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("judge") / "policy", **TINY)


@pytest.fixture(scope="module")
def echo_dir(policy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real judge model whose verdicts are known: with its blocks' output projections zeroed,
    each position's hidden state is its token's embedding, so (embeddings tied to the output)
    greedy decoding repeats the prompt's last token: a prompt ending in the response "7" gets
    the verdict "7"."""
    model = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    out = tmp_path_factory.mktemp("judge") / "echo"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy_dir, local_files_only=True).save_pretrained(out)
    return out


def judge(echo_dir: Path, **settings: Any) -> Judge:
    kw: dict[str, Any] = {"template": TEMPLATE, "parse": "number", "min_score": 0.0,
                          "max_score": 10.0, "default": -1.0, "max_new_tokens": 1,
                          "max_prompt_tokens": 64, "stop": ("\n",), **settings}
    tok = AutoTokenizer.from_pretrained(echo_dir, local_files_only=True)
    return Judge(HFRolloutEngine(echo_dir, device="cpu"), tok, **kw)


def samples(*responses: str) -> list[RewardSample]:
    return [RewardSample("2+5=", r, {"answer": "7"}) for r in responses]


@pytest.mark.parametrize(("text", "kind", "expected"), [
    ("7", "number", 0.7),
    (" 7/10, well argued", "number", 0.7),
    ("Score: 10", "number", 1.0),
    ("0", "number", 0.0),
    ("2.5 out of 10", "number", 0.25),
    ("12", "number", None),  # outside the scale
    ("-1", "number", None),
    ("seven", "number", None),
    ("", "number", None),
    ("Yes, it is right", "yes_no", 1.0),
    (" no.", "yes_no", 0.0),
    ("NO", "yes_no", 0.0),
    ("maybe yes", "yes_no", None),  # the first word decides
    ("yesterday", "yes_no", None),
    ("", "yes_no", None),
])
def test_parse_verdict(text: str, kind: Any, expected: float | None) -> None:
    got = parse_verdict(text, kind, min_score=0.0, max_score=10.0)
    assert got == (None if expected is None else pytest.approx(expected))


def test_parse_verdict_scales_any_range() -> None:
    assert parse_verdict("4", "number", min_score=1, max_score=5) == pytest.approx(0.75)
    assert parse_verdict("0", "number", min_score=1, max_score=5) is None


def test_templates_are_filled_literally_in_one_pass() -> None:
    text = fill_template("Q: {prompt} {{x}} \\boxed{} A: {response} ({answer})",
                         {"prompt": "{response}", "response": "{answer}", "answer": "7"})
    assert text == "Q: {response} {{x}} \\boxed{} A: {answer} (7)"


async def test_a_real_models_verdicts_are_parsed_and_unparsable_ones_counted(
    echo_dir: Path,
) -> None:
    runner = RewardRunner(judge(echo_dir), batched=True, timeout_s=60, max_concurrency=2)
    out = await runner.score(samples("7", "3", " cat", "0"))
    assert [r.reward for r in out] == pytest.approx([0.7, 0.3, -1.0, 0.0])
    assert [r.ok for r in out] == [True, True, False, True]
    assert out[2].kind == "unparsable"
    assert out[2].error == ("no score in the judge's verdict ' cat' (expected a number in "
                            "[0, 10])")
    assert runner.statistics().failures["unparsable"] == 1
    assert runner.statistics().failures["error"] == 0
    # Greedy: the same verdicts again.
    assert await runner.score(samples("7", "3", " cat", "0")) == out


async def test_a_verdict_outside_the_scale_is_unparsable(echo_dir: Path) -> None:
    # Two tokens of verdict: "7" becomes "77", beyond 0..10.
    runner = RewardRunner(judge(echo_dir, max_new_tokens=2), batched=True, timeout_s=60,
                          max_concurrency=1)
    (out,) = await runner.score(samples("7"))
    assert out == RewardResult(-1.0, False, "no score in the judge's verdict '77' (expected a "
                                            "number in [0, 10])", "unparsable")


async def test_yes_no_verdicts(echo_dir: Path) -> None:
    runner = RewardRunner(judge(echo_dir, parse="yes_no", default=0.5), batched=True,
                          timeout_s=60, max_concurrency=1)
    out = await runner.score(samples(" yes", " no", " cat"))
    assert [(r.reward, r.kind) for r in out] == [(1.0, None), (0.0, None), (0.5, "unparsable")]


async def test_a_long_judge_prompt_keeps_its_end(echo_dir: Path) -> None:
    j = judge(echo_dir, max_prompt_tokens=4)
    long_prompt = " ".join(["apple"] * 200)
    assert j(["x"], ["7"], [{}]) == pytest.approx([0.7])
    assert j([long_prompt], ["7"], [{}]) == pytest.approx([0.7])


async def test_the_reward_role_of_a_recipe_serves_the_judge(policy_dir: Path,
                                                           echo_dir: Path) -> None:
    recipe = Recipe(
        steps=1, model=ModelConfig(path=str(policy_dir)), data=DataConfig(max_prompt_tokens=16),
        reward=RewardConfig(judge=JudgeConfig(path=str(echo_dir), template=TEMPLATE,
                                              max_new_tokens=1, max_prompt_tokens=64,
                                              default=-2.0)))
    config = recipe.engine_config()
    role = make_hf_role("reward", config, seed=0)
    assert isinstance(role, RewardRole)
    tok = role.tokenizer
    ids = [torch.tensor([*tok(r).input_ids, tok.eos_token_id]) for r in ("9", " dog", "5")]
    task: m.TaskMsg = {"task_id": 1, "stage": "reward", "rows": [0, 1, 2], "groups": [0],
                       "row_groups": [0, 0, 0], "inputs": {}, "params": {}}
    out = await role.run(task, {"prompt": [3, 3, 3], "response_ids": ids})
    assert out.fields["reward"] == pytest.approx([0.9, -2.0, 0.5])
    assert out.metrics["reward_failed"] == 1.0
    assert out.metrics["reward_failed_unparsable"] == 1.0
