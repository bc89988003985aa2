"""Per-token KL estimators (Schulman, "Approximating KL Divergence", 2020) and the KL loss term.

With tokens sampled from the policy q = π_θ and the reference p = π_ref, and
``log_r = log p(x) − log q(x) = ref_logprobs − logprobs``:

- ``k1 = −log_r``                 unbiased, high variance, can be negative;
- ``k2 = ½·log_r²``               biased (low when q ≈ p), low variance, non-negative;
- ``k3 = (exp(log_r) − 1) − log_r`` unbiased, low variance, non-negative (GRPO's KL loss; verl's
  "low_var_kl" without its clamp).

All three estimate KL(π_θ ‖ π_ref). The estimate is 0 at masked positions and gradients flow to
``logprobs`` only (``ref_logprobs`` is detached). Imports torch only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ._common import LossAgg, aggregate_loss, as_bool_mask

KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: KLEstimator = "k3",
) -> Tensor:
    """Per-token KL estimate ``[B, T]`` (zero where ``mask`` is 0)."""
    m = as_bool_mask(mask, logprobs)
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != {tuple(logprobs.shape)}"
        )
    # Zero-fill first so padding garbage (inf/nan) reaches neither the value nor the gradient.
    log_r = ref_logprobs.detach().masked_fill(~m, 0.0) - logprobs.masked_fill(~m, 0.0)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2' or 'k3'")
    return kl.masked_fill(~m, 0.0)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    coef: float,
    estimator: KLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """``coef · aggregate(kl_estimate(...))``: the KL-to-reference loss term (GRPO: k3, 0.001–0.04).

    Aggregated with the same mode and counts as the policy loss, so both terms weigh tokens alike.
    """
    kl = kl_estimate(logprobs, ref_logprobs, mask, estimator)
    agg = aggregate_loss(
        kl, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, max_tokens=max_tokens
    )
    return coef * agg
