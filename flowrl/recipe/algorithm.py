"""The ``algorithm`` section: the RL objective, and the recipe's spellings of its
loss aggregations."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from flowrl.recipe.section import _rule, _Section
from flowrl.worker_spec import CorrectionName, PolicyLossAgg, PolicyLossName

DEFAULT_TIS_CAP = 2.0
"""Truncated-importance-sampling cap used when samples may be stale (mirrors
``flowrl.algorithms.DEFAULT_TIS_CAP``; this module may not import torch)."""

DEFAULT_MASK_BOUNDS = (0.5, 2.0)
"""Ratio bounds of the masking corrections when samples may be stale (mirrors
``flowrl.algorithms.DEFAULT_MASK_BOUNDS``)."""

CLIP_DEFAULTS: dict[PolicyLossName, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
}
"""(clip_low, clip_high) of each policy loss when the recipe gives none (mirrors
``flowrl.algorithms.CLIP_DEFAULTS``)."""

LossAggName = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

LOSS_AGG_ALGORITHM_NAMES: dict[str, PolicyLossAgg] = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
"""Recipe spelling → the spelling `flowrl.algorithms.compute_policy_loss` takes (verl's)."""

TRUNCATING_CORRECTIONS: tuple[CorrectionName, ...] = ("tis", "seq_tis")
"""The corrections that cap their weights at `AlgorithmConfig.tis_cap`; the others mask outside
`AlgorithmConfig.mask_bounds` (mirrors ``flowrl.algorithms.MASKING_KINDS``)."""


class AlgorithmConfig(_Section):
    """The RL objective: advantage estimator, policy loss, clipping, KL, loss aggregation,
    rollout corrections."""

    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    """Advantage estimator: GRPO, Dr. GRPO (no std normalisation), RLOO, REINFORCE++, PPO."""
    group_size: int = Field(default=4, ge=1, le=1024)
    """Responses sampled per prompt (the group whose rewards form the baseline)."""
    kl_coef: float = Field(default=0.0, ge=0.0, le=100.0)
    """Weight of the KL(π‖π_ref) loss term; 0 disables it and the reference stage."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman 2020); k3 is GRPO's."""
    kl_in_reward: bool = False
    """Where the KL to the reference goes. False: a loss term, ``kl_coef·KL(π_θ‖π_ref)``
    (GRPO's). True: into the rewards before the advantage estimator (verl's
    ``use_kl_in_reward``, PPO as in InstructGPT): every response token's reward gets
    ``−kl_coef·KL_t(π_old‖π_ref)`` and there is no KL loss term; the group estimators see a
    row's reward minus ``kl_coef·Σ_t KL_t``, REINFORCE++ and PPO's GAE the per-token rewards.
    PPO's critic stage scores the rows before the trainer has, so there π_old is the policy that
    sampled them (``rollout_logprobs``). Needs ``kl_coef > 0``."""
    policy_loss: PolicyLossName = "ppo_clip"
    """The policy objective: ``ppo_clip`` (PPO's clipped surrogate per token, with DAPO's
    clip-higher through `clip_high`), ``gspo`` (GSPO: one importance ratio per sequence, the
    geometric mean of its tokens', clipped at sequence level) or ``cispo`` (CISPO: the
    importance weight is clipped and detached, every token keeps its gradient). See
    `flowrl.algorithms.losses`."""
    clip_low: float | None = Field(default=None, ge=0.0, le=1.0)
    """Ratio clip below 1: ratios under ``1 - clip_low`` are clipped (1: no lower clip). None:
    the policy loss's default, 0.2 for ppo_clip, GSPO's 3e-4, 1.0 for cispo (no lower bound, as
    CISPO)."""
    clip_high: float | None = Field(default=None, ge=0.0, le=10.0)
    """Ratio clip above 1 (DAPO's clip-higher uses 0.28). None: the same as `clip_low` for
    ppo_clip, GSPO's 4e-4, 0.28 for cispo."""
    loss_agg: LossAggName | None = None
    """How per-token losses become one number: over all tokens, per sequence then averaged, or
    per-sequence sums over a fixed token budget (Dr. GRPO). None: ``seq_mean_token_mean`` for
    gspo (the paper's mean of sequence losses), ``token_mean`` otherwise."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no learning signal) and sample replacements
    (DAPO)."""
    entropy_coef: float = Field(default=0.0, ge=0.0, le=1.0)
    """Weight of an entropy bonus (``loss −= entropy_coef · agg(entropy)``), the entropy
    estimated from the sampled tokens (`flowrl.algorithms.sampled_entropy`). It keeps a policy
    from collapsing onto one answer per prompt before it has found the right one; 0 disables
    it."""
    correction: CorrectionName = "tis"
    """How stale samples (and the rollout engine's numerical mismatch) are corrected, from the
    ratio π_old/π_rollout per token or per sequence (its product over the response):
    truncated importance sampling per token (``tis``) or per sequence (``seq_tis``), capped at
    `tis_cap`; or masking, which drops the sequences (``mis``) or tokens (``icepop``) whose
    ratio is outside `mask_bounds` and weights the rest by their ratio. See
    `flowrl.algorithms.corrections`."""
    tis_cap: float | Literal["auto"] | None = "auto"
    """Cap of the ``tis`` and ``seq_tis`` corrections; ``"auto"`` means 2.0 while
    ``max_staleness > 0`` is in force (also when raised mid-run) and off otherwise, None turns
    it off."""
    mask_bounds: tuple[float, float] | Literal["auto"] | None = "auto"
    """Ratio bounds ``(low, high)`` of the ``mis`` and ``icepop`` corrections, with
    ``0 <= low <= 1 <= high``; ``"auto"`` means (0.5, 2.0) while ``max_staleness > 0`` is in
    force and off otherwise, None turns it off."""

    @field_validator("tis_cap")
    @classmethod
    def _positive_cap(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not (v > 0.0 and math.isfinite(v)):
            raise ValueError(f"must be a positive finite number, 'auto' or None, got {v}")
        return v

    @field_validator("mask_bounds")
    @classmethod
    def _ordered_bounds(
        cls, v: tuple[float, float] | str | None
    ) -> tuple[float, float] | str | None:
        if isinstance(v, tuple):
            low, high = v
            if not (0.0 <= low <= 1.0 <= high and low < high and math.isfinite(high)):
                raise ValueError(f"need 0 <= low <= 1 <= high (finite) and low < high, got {v}")
        return v

    @model_validator(mode="after")
    def _groups(self) -> AlgorithmConfig:
        if self.name in ("grpo", "dr_grpo", "rloo") and self.group_size < 2:
            raise _rule("group_size", f"{self.name} needs groups of at least 2 responses")
        if self.kl_in_reward and self.kl_coef == 0.0:
            raise _rule("kl_in_reward", "folds kl_coef·KL into the rewards: set kl_coef > 0")
        if self.dynamic_sampling and self.group_size < 2:
            raise _rule("dynamic_sampling", "needs group_size >= 2 (a group of one is always "
                        "dropped)")
        return self

    @model_validator(mode="after")
    def _correction_settings(self) -> AlgorithmConfig:
        # A setting the chosen correction never reads is a mistake, not a no-op.
        if self.correction in TRUNCATING_CORRECTIONS and isinstance(self.mask_bounds, tuple):
            raise _rule("mask_bounds", f"applies to the masking corrections ('mis', 'icepop'); "
                        f"correction {self.correction!r} truncates at tis_cap")
        if self.correction not in TRUNCATING_CORRECTIONS and isinstance(self.tis_cap, float):
            raise _rule("tis_cap", f"applies to the truncating corrections ('tis', 'seq_tis'); "
                        f"correction {self.correction!r} masks outside mask_bounds")
        return self

    @property
    def clip_low_resolved(self) -> float:
        """`clip_low`, or the policy loss's default when it is None."""
        return CLIP_DEFAULTS[self.policy_loss][0] if self.clip_low is None else self.clip_low

    @property
    def clip_high_resolved(self) -> float:
        """`clip_high`, or when it is None: `clip_low` (resolved) for ppo_clip, the policy
        loss's default otherwise."""
        if self.clip_high is not None:
            return self.clip_high
        if self.policy_loss == "ppo_clip":
            return self.clip_low_resolved
        return CLIP_DEFAULTS[self.policy_loss][1]

    @property
    def loss_agg_resolved(self) -> LossAggName:
        """`loss_agg`, or when it is None the policy loss's natural one."""
        if self.loss_agg is not None:
            return self.loss_agg
        return "seq_mean_token_mean" if self.policy_loss == "gspo" else "token_mean"
