"""The default job's task: its reward function, its warm-up corpus and its recipe."""

from __future__ import annotations

import re

import pytest

from flowrl.recipe_file import load_recipe
from flowrl.tiny_model import synthetic_corpus
from workers.roles.builtin_rewards import (
    exact_match,
    exact_match_batch,
    numeric_partial_credit,
    numeric_partial_credit_batch,
)


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("7", "7", 1.0),
        (" 7", "7", 1.0),
        ("7 apples", "7", 1.0),
        ("10", "10", 1.0),
        ("8", "7", 0.45),
        ("5", "7", 0.4),
        ("17", "7", 0.0),  # ten away: no credit left
        ("70", "7", 0.0),  # the answer as a prefix of another number is not the answer
        ("7a", "7", 0.5),  # the right number run into text: partial credit only
        ("-3", "3", 0.2),
        ("seven", "7", 0.0),
        ("", "7", 0.0),
        ("12", "twelve", 0.0),  # an answer that is no integer gets exact matches only
        ("twelve", "twelve", 1.0),
    ],
)
def test_partial_credit(response: str, answer: str, expected: float) -> None:
    assert numeric_partial_credit("3+4=", response, answer=answer) == pytest.approx(expected)


def test_every_exact_answer_outranks_every_wrong_one() -> None:
    wrong = [numeric_partial_credit("", f"{n}", answer="9") for n in range(-20, 40) if n != 9]
    assert max(wrong) < 0.5 < numeric_partial_credit("", "9", answer="9")


def test_batched_form_matches_per_sample() -> None:
    responses = ["3", "4", "x", "12"]
    metas = [{"answer": "3"}, {"answer": "3"}, {"answer": "3"}, {"answer": "11"}]
    assert numeric_partial_credit_batch([""] * 4, responses, metas) == [
        numeric_partial_credit("", r, answer=m["answer"])
        for r, m in zip(responses, metas, strict=True)
    ]
    with pytest.raises(ValueError, match=r"shorter|longer"):
        numeric_partial_credit_batch([""], responses, metas)
    assert exact_match_batch([""] * 4, responses, metas) == [1.0, 0.0, 0.0, 0.0]
    assert exact_match_batch([""] * 4, responses, metas) == [
        exact_match("", r, answer=m["answer"]) for r, m in zip(responses, metas, strict=True)]


def test_arithmetic_corpus_is_single_digit_arithmetic() -> None:
    lines = synthetic_corpus(3, lines=500, kind="arithmetic")
    assert len(lines) == 500
    for line in lines:
        m = re.fullmatch(r"(\d)([+\-*])(\d)=(\d+)", line)
        assert m is not None, line
        a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
        assert c == (a + b if op == "+" else a - b if op == "-" else a * b), line
    assert synthetic_corpus(3, lines=500, kind="arithmetic") == lines
    # The default corpus is unchanged by the option (its digest keys cached models).
    assert synthetic_corpus(0, lines=30) == synthetic_corpus(0, lines=30, kind="mixed")
    with pytest.raises(ValueError, match="unknown corpus"):
        synthetic_corpus(0, kind="poems")  # type: ignore[arg-type]


def test_default_recipe_compiles_to_the_documented_job() -> None:
    recipe = load_recipe("recipes/tiny_cpu.py")
    assert recipe.max_staleness == 1
    assert recipe.model.tiny.corpus == "arithmetic"
    # A warm-up to a target, not a number of steps (the recipe says why).
    assert (recipe.model.tiny.pretrain_until, recipe.model.tiny.pretrain_steps) == (0.5, 4000)
    spec = recipe.to_pipeline()
    threads = {p.role: p.threads for p in spec.pools}
    assert threads["rollout"] == threads["train"] == 1
    config = spec.engine_config
    assert config["reward"]["fn"] == "workers.roles.builtin_rewards:numeric_partial_credit_batch"
    assert config["reward"]["batched"] is True
    assert recipe.tis_cap == 2.0  # stale samples are corrected
    # Two groups per generate call, with the rate decaying over the run (the recipe says why).
    assert recipe.rollout.groups_per_task == 2
    assert (config["trainer"]["lr_schedule"], config["trainer"]["min_lr_ratio"]) == ("cosine", 0.1)
