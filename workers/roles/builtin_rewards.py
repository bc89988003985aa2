"""Built-in reward functions (`workers.roles.reward_runner` calls them, as any user function).

A recipe names one as ``"workers.roles.builtin_rewards:<name>"``: per-sample functions are called
``fn(prompt, response, *, answer, **meta) -> float``, batched ones (``RewardConfig(batched=True)``)
``fn(prompts, responses, metas) -> list[float]``. Pure standard library; deterministic.

- `exact_match` (the recipe's default): 1.0 when the response starts with the answer, else 0.0;
  `exact_match_batch` is its batched form.
- `numeric_partial_credit`: the exact answer scores 1.0 (the same check as `exact_match`); a
  response that starts with another integer scores by its distance to the answer, at most 0.5,
  so every exact answer outranks every wrong one; anything else scores 0.0. The shaping gives a
  group of wrong answers a gradient towards the right one, which is what lets a tiny policy
  learn small arithmetic in a few thousand samples.
  `numeric_partial_credit_batch` is the same per micro-batch (``RewardConfig(batched=True)``):
  one call, hence one reward thread, per task instead of one per sample.
- `gsm8k_numeric`: 1.0 when the final number of the response equals the gold number of a
  GSM8K answer (the number after ``####``), else 0.0. The response's final number is, in order
  of preference, the last ``#### N``, the last ``\\boxed{N}``, the last ``answer is N``, else
  the last number in the text. Numbers compare as decimals: thousands separators and a leading
  ``$`` are ignored, ``3.50`` equals ``3.5``, ``-7`` is negative. `gsm8k_numeric_batch` is its
  batched form.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "exact_match",
    "exact_match_batch",
    "final_number",
    "gsm8k_gold",
    "gsm8k_numeric",
    "gsm8k_numeric_batch",
    "numeric_partial_credit",
    "numeric_partial_credit_batch",
]

_LEADING_INT = re.compile(r"\s*(-?\d+)")
_INT = re.compile(r"-?\d+")


def exact_match(prompt: str, response: str, *, answer: Any, **_: Any) -> float:
    """1.0 when the response starts with the answer and the answer ends there, else 0.0.

    Leading whitespace is ignored; the character after the answer must not be a letter or digit,
    so ``"19"`` matches ``" 19"``, ``"19."`` and ``"19 apples"`` but not ``"190"``.
    """
    want = str(answer).strip()
    got = response.lstrip()
    if not want or not got.startswith(want):
        return 0.0
    rest = got[len(want):]
    return 0.0 if rest[:1].isalnum() else 1.0


def exact_match_batch(
    prompts: Sequence[str], responses: Sequence[str], metas: Sequence[Mapping[str, Any]]
) -> list[float]:
    """`exact_match` of each sample, for ``RewardConfig(batched=True)``."""
    return [exact_match(p, r, **m) for p, r, m in zip(prompts, responses, metas, strict=True)]


def numeric_partial_credit(
    prompt: str, response: str, *, answer: Any, scale: float = 10.0, **_: Any
) -> float:
    """1.0 for the exact answer; ``0.5 · max(0, 1 − |n − answer| / scale)`` for a response that
    starts with a different integer ``n``; 0.0 otherwise (also when ``answer`` is no integer and
    the response does not match it exactly)."""
    if exact_match(prompt, response, answer=answer):
        return 1.0
    want = str(answer).strip()
    got = _LEADING_INT.match(response)
    if got is None or _INT.fullmatch(want) is None:
        return 0.0
    distance = abs(int(got.group(1)) - int(want))
    return 0.5 * max(0.0, 1.0 - distance / scale)


def numeric_partial_credit_batch(
    prompts: Sequence[str], responses: Sequence[str], metas: Sequence[Mapping[str, Any]]
) -> list[float]:
    """`numeric_partial_credit` of each sample, for ``RewardConfig(batched=True)``."""
    return [numeric_partial_credit(p, r, **m)
            for p, r, m in zip(prompts, responses, metas, strict=True)]


# ---- GSM8K-style numeric answers ----------------------------------------------------------------

# A number as people write it: optional sign (ASCII or Unicode minus), optional $ (or TeX's
# \$), digits with optional thousands separators, optional decimals. A free-standing number is
# not preceded by a letter, digit or dot, so "x2" and the "5" of "1.5" are not numbers.
_NUM = r"[-\u2212]?(?:\\?\$)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUM})")
_MARKED = (
    re.compile(rf"####\s*(?P<n>{_NUM})"),
    re.compile(rf"\\boxed\s*\{{\s*(?:\\text\{{\s*)?(?P<n>{_NUM})"),
    re.compile(rf"answer\s+is\s*:?\s*(?:\\\(|\$\$?)?\s*(?P<n>{_NUM})", re.IGNORECASE),
)
_DROP = str.maketrans("", "", ",$\\")


def _decimal(text: str) -> Decimal | None:
    cleaned = text.translate(_DROP).replace("\u2212", "-")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def final_number(text: str) -> Decimal | None:
    """The number a response gives as its final answer (preference order in the module doc)."""
    for pattern in _MARKED:
        found = list(pattern.finditer(text))
        if found:
            return _decimal(found[-1].group("n"))
    numbers = _NUMBER_RE.findall(text)
    return _decimal(numbers[-1]) if numbers else None


def gsm8k_gold(answer: Any) -> Decimal | None:
    """The gold number of a GSM8K answer field (``"... #### 42"``), or of a bare number."""
    text = str(answer)
    _, sep, tail = text.rpartition("####")
    return final_number(tail if sep else text)


def gsm8k_numeric(prompt: str, response: str, *, answer: Any, **_: Any) -> float:
    """1.0 when the response's final number equals the gold number, else 0.0 (also when the
    answer field has no number)."""
    gold = gsm8k_gold(answer)
    got = final_number(response)
    return 1.0 if gold is not None and got is not None and got == gold else 0.0


def gsm8k_numeric_batch(
    prompts: Sequence[str], responses: Sequence[str], metas: Sequence[Mapping[str, Any]]
) -> list[float]:
    """`gsm8k_numeric` of each sample, for ``RewardConfig(batched=True)``."""
    return [gsm8k_numeric(p, r, **m) for p, r, m in zip(prompts, responses, metas, strict=True)]
