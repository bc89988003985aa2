"""The reward model: a real tiny sequence classifier scores texts in batches exactly as a direct
forward pass of the same model scores each alone, deterministically, and the reward role built
from a recipe serves it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from flowrl import messages as m
from flowrl.recipe import DataConfig, ModelConfig, Recipe, RewardConfig, RewardModelConfig
from flowrl.tiny_model import build_tiny_model
from workers.devices import set_threads
from workers.engines.reward_model import RewardModelEngine
from workers.roles.factory import dataset_from_config, make_hf_role
from workers.roles.reward_role import RewardRole

set_threads(1)

TINY: dict[str, Any] = {"hidden": 32, "layers": 2, "heads": 2, "kv_heads": 1, "vocab_size": 300,
                        "max_positions": 128}
TEXTS = ["1+2=3", "the quick brown fox jumps over the lazy dog", "7", "12+30=42 and then some",
         "no", "a b c d e f g h i j k l m n o p", "9*9=81"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rm") / "rm", head="score", **TINY)


@pytest.fixture(scope="module")
def direct(rm_dir: Path) -> Any:
    """The same model loaded on its own, scored one text at a time (no padding anywhere)."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(rm_dir, local_files_only=True)
    model.eval()

    @torch.inference_mode()
    def score(text: str, last: int | None = None) -> float:
        ids = tok(text).input_ids
        ids = ids[-last:] if last else ids
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])

    return score


def test_batches_score_as_a_direct_forward_pass_of_each_text(rm_dir: Path, direct: Any) -> None:
    engine = RewardModelEngine(rm_dir, max_length=64, batch_size=3, device="cpu")
    scores = engine.score(TEXTS)  # batches of 3, 3 and 1, texts of different lengths
    want = [direct(t) for t in TEXTS]
    assert scores == pytest.approx(want, abs=1e-5)
    assert len(set(scores)) == len(TEXTS)  # a real score per text, not a constant
    # Deterministic, and a text's score does not depend on the batch it is in.
    assert engine.score(TEXTS) == scores
    alone = RewardModelEngine(rm_dir, max_length=64, batch_size=1, device="cpu")
    assert alone.score(TEXTS) == pytest.approx(scores, abs=1e-5)
    assert engine.score(TEXTS[::-1]) == pytest.approx(scores[::-1], abs=1e-5)


def test_a_long_text_keeps_its_end(rm_dir: Path, direct: Any) -> None:
    text = " ".join(["apple"] * 40) + " the answer is 7"
    engine = RewardModelEngine(rm_dir, max_length=8, batch_size=4, device="cpu")
    assert engine.score([text, "7"]) == pytest.approx([direct(text, last=8), direct("7")],
                                                      abs=1e-5)
    assert engine.score([text])[0] != pytest.approx(direct(text), abs=1e-5)


def test_called_as_a_reward_function_it_scores_prompt_plus_response(rm_dir: Path,
                                                                   direct: Any) -> None:
    engine = RewardModelEngine(rm_dir, max_length=64, batch_size=2, device="cpu")
    got = engine(["1+2=", "3+4="], ["3", "9"], [{"answer": "3"}, {"answer": "7"}])
    assert got == pytest.approx([direct("1+2=3"), direct("3+4=9")], abs=1e-5)


def test_a_model_without_a_pad_token_pads_with_its_tokenizers(
    tmp_path: Path, rm_dir: Path, direct: Any
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(rm_dir, bare)
    config = json.loads((bare / "config.json").read_text())
    config["pad_token_id"] = None  # transformers refuses batches of such a model by itself
    (bare / "config.json").write_text(json.dumps(config))
    engine = RewardModelEngine(bare, max_length=64, batch_size=4, device="cpu")
    assert engine.pad_id == engine.tokenizer.pad_token_id
    assert engine.score(TEXTS) == pytest.approx([direct(t) for t in TEXTS], abs=1e-5)


def test_a_model_with_more_than_one_label_is_refused(tmp_path: Path) -> None:
    # A causal LM's directory loads as a classifier with transformers' default of two labels.
    lm = build_tiny_model(tmp_path / "lm", **TINY)
    with pytest.raises(ValueError, match=r"one label \(num_labels=1\), this one has 2"):
        RewardModelEngine(lm, max_length=16, batch_size=2, device="cpu")


async def test_the_reward_role_of_a_recipe_serves_the_model(
    tmp_path: Path, rm_dir: Path, direct: Any
) -> None:
    policy = build_tiny_model(tmp_path / "policy", **TINY)  # the same tokenizer as the RM's
    recipe = Recipe(steps=1, model=ModelConfig(path=str(policy)),
                    data=DataConfig(max_prompt_tokens=16),
                    reward=RewardConfig(model=RewardModelConfig(path=str(rm_dir), max_length=64,
                                                                batch_size=2)))
    config = recipe.engine_config()
    assert config["reward"]["fn"] is None
    role = make_hf_role("reward", config, seed=0)
    assert isinstance(role, RewardRole)
    dataset = dataset_from_config(config)
    tok = role.tokenizer
    responses = [" 5", "12", "dog"]
    ids = [torch.tensor([*tok(r).input_ids, tok.eos_token_id]) for r in responses]
    task: m.TaskMsg = {"task_id": 1, "stage": "reward", "rows": [0, 1, 2], "groups": [0, 1],
                       "row_groups": [0, 0, 1], "inputs": {}, "params": {}}
    out = await role.run(task, {"prompt": [4, 4, 9], "response_ids": ids})
    want = [direct(dataset.at(p).prompt + r) for p, r in zip([4, 4, 9], responses, strict=True)]
    assert out.fields["reward"] == pytest.approx(want, abs=1e-5)
    assert out.metrics["reward_failed"] == 0.0
