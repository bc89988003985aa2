"""RL algorithm math as pure torch functions: advantages, policy/value losses, rollout
corrections, KL, sampling.

Imports torch only, so worker processes may import it. Shapes: token tensors are padded
``[B, T]`` with a bool/float response mask; sequence rewards are ``[B]``; groups are ``[B]``
integer group ids (variable sizes allowed) or ``[G, n]`` rewards. See each module's docstring for
the exact definitions and the variant each function follows.
"""

from ._common import LossAgg, aggregate_loss, masked_mean
from .advantages import (
    discounted_returns,
    dr_grpo_advantages,
    expand_to_tokens,
    gae_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
)
from .corrections import (
    DEFAULT_MASK_BOUNDS,
    DEFAULT_TIS_CAP,
    MASKING_KINDS,
    CorrectionKind,
    RolloutCorrection,
    correction_weights,
    default_tis_cap,
    tis_weights,
)
from .kl import KLEstimator, kl_estimate, kl_loss
from .losses import (
    CLIP_DEFAULTS,
    PolicyLoss,
    clip_range,
    compute_policy_loss,
    sampled_entropy,
    value_loss,
)
from .sampling import GroupFilter, filter_groups

__all__ = [
    "CLIP_DEFAULTS",
    "DEFAULT_MASK_BOUNDS",
    "DEFAULT_TIS_CAP",
    "MASKING_KINDS",
    "CorrectionKind",
    "GroupFilter",
    "KLEstimator",
    "LossAgg",
    "PolicyLoss",
    "RolloutCorrection",
    "aggregate_loss",
    "clip_range",
    "compute_policy_loss",
    "correction_weights",
    "default_tis_cap",
    "discounted_returns",
    "dr_grpo_advantages",
    "expand_to_tokens",
    "filter_groups",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "kl_loss",
    "masked_mean",
    "masked_whiten",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sampled_entropy",
    "tis_weights",
    "token_level_rewards",
    "value_loss",
]
