"""Built-in reward functions for the synthetic tasks (`workers.roles.reward` runs them).

A recipe names one as ``"workers.roles.rewards:<name>"``: per-sample functions are called
``fn(prompt, response, *, answer, **meta) -> float``, batched ones (``RewardConfig(batched=True)``)
``fn(prompts, responses, metas) -> list[float]``. Pure standard library; deterministic.

- `numeric_partial_credit`: the exact answer scores 1.0 (the same check as
  `workers.roles.reward.exact_match`); a response that starts with another integer scores by its
  distance to the answer, at most 0.5, so every exact answer outranks every wrong one; anything
  else scores 0.0. The shaping gives a group of wrong answers a gradient towards the right one,
  which is what lets a tiny policy learn small arithmetic in a few thousand samples.
  `numeric_partial_credit_batch` is the same per micro-batch (``RewardConfig(batched=True)``):
  one call, hence one reward thread, per task instead of one per sample.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from workers.roles.reward import exact_match

__all__ = ["numeric_partial_credit", "numeric_partial_credit_batch"]

_LEADING_INT = re.compile(r"\s*(-?\d+)")
_INT = re.compile(r"-?\d+")


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
