"""The ``algorithm`` section: the RL objective, and the recipe's spellings of its
loss aggregations."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from flowrl.recipe.section import _rule, _Section
from flowrl.worker_spec import PolicyLossAgg

DEFAULT_TIS_CAP = 2.0
"""Truncated-importance-sampling cap used when samples may be stale (mirrors
``flowrl.algorithms.DEFAULT_TIS_CAP``; this module may not import torch)."""

LossAggName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

LOSS_AGG_ALGORITHM_NAMES: dict[str, PolicyLossAgg] = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
"""Recipe spelling → the spelling `flowrl.algorithms.compute_policy_loss` takes (verl's)."""


class AlgorithmConfig(_Section):
    """The RL objective: advantage estimator, clipping, KL, loss aggregation, corrections."""

    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    """Advantage estimator: GRPO, Dr. GRPO (no std normalisation), RLOO, REINFORCE++, PPO."""
    group_size: int = Field(default=4, ge=1, le=1024)
    """Responses sampled per prompt (the group whose rewards form the baseline)."""
    kl_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of the KL(π‖π_ref) loss term; 0 disables it and the reference stage."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020); k3 is GRPO's."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """PPO ratio clip below 1: ratios under ``1 - clip_low`` are clipped."""
    clip_high: float | None = Field(default=None, ge=0.0, le=10.0)
    """Ratio clip above 1 (DAPO's clip-higher uses 0.28); None means the same as `clip_low`."""
    loss_agg: LossAggName = "token_mean"
    """How per-token losses become one number: over all tokens, per sequence then averaged, or
    per-sequence sums over a fixed token budget (Dr. GRPO)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and sample replacements
    (DAPO)."""
    entropy_coef: float = Field(default=0.0, ge=0.0, le=1.0)
    """Weight of an entropy bonus (``loss −= entropy_coef · agg(entropy)``), the entropy
    estimated from the sampled tokens (`flowrl.algorithms.sampled_entropy`). It keeps a policy
    from collapsing onto one answer per prompt before it has found the right one; 0 disables
    it."""
    tis_cap: float | Literal["auto"] | None = "auto"
    """Truncated importance-sampling cap for stale samples; ``"auto"`` means 2.0 while
    ``max_staleness > 0`` is in force (also when raised mid-run) and off otherwise, None turns
    it off."""

    @field_validator("tis_cap")
    @classmethod
    def _positive_cap(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not (v > 0.0 and math.isfinite(v)):
            raise ValueError(f"must be a positive finite number, 'auto' or None, got {v}")
        return v

    @model_validator(mode="after")
    def _groups(self) -> AlgorithmConfig:
        if self.name in ("grpo", "dr_grpo", "rloo") and self.group_size < 2:
            raise _rule("group_size", f"{self.name} needs groups of at least 2 responses")
        if self.dynamic_sampling and self.group_size < 2:
            raise _rule("dynamic_sampling", "needs group_size >= 2 (a group of one is always "
                        "dropped)")
        return self

    @property
    def clip_high_resolved(self) -> float:
        """`clip_high`, or `clip_low` when it is None."""
        return self.clip_low if self.clip_high is None else self.clip_high
