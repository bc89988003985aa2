"""Policy and value losses: PPO clipped surrogate with DAPO options, truncated importance sampling
for stale samples, the KL-to-reference term, and PPO's clipped value loss.

``compute_policy_loss`` is the one entry the trainer calls per micro-batch. It returns a scalar
loss whose gradient reaches ``logprobs`` (and ``entropy`` when an entropy bonus is set) only at
valid tokens, and a dict of plain floats for logging (one device sync for all of them).

Truncated importance sampling (TIS). A sample generated ``s`` versions ago was drawn from the
rollout policy, not from the policy that computed ``old_logprobs``. Each token's loss is
multiplied by the detached weight ``min(exp(old_logprobs − rollout_logprobs), tis_cap)``. It is
on when ``tis_cap`` is a number and off when it is None; the recipe layer decides, by default
``default_tis_cap(max_staleness)``: 2.0 when ``max_staleness > 0``, off for strictly on-policy
runs. (It also corrects the rollout-engine/trainer numerical mismatch at staleness 0, if one wants
that.) Imports torch only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._common import LossAgg, aggregate_loss, as_bool_mask, masked_mean
from .kl import KLEstimator, kl_estimate

DEFAULT_TIS_CAP = 2.0
# |log ratio| beyond this is far outside any clip range; clamping keeps exp() finite (as verl).
_MAX_LOG_RATIO = 20.0


def default_tis_cap(max_staleness: int) -> float | None:
    """The TIS cap a recipe should use: ``DEFAULT_TIS_CAP`` when samples may be stale, else None."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return DEFAULT_TIS_CAP if max_staleness > 0 else None


def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float = DEFAULT_TIS_CAP
) -> Tensor:
    """Detached per-token weights ``min(exp(old_logprobs − rollout_logprobs), cap)``.

    0 at masked positions.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be positive, got {cap}")
    m = as_bool_mask(mask, old_logprobs)
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} != {tuple(old_logprobs.shape)}"
        )
    log_w = old_logprobs.detach().masked_fill(~m, 0.0) - rollout_logprobs.detach().masked_fill(
        ~m, 0.0
    )
    # min(log_w, log cap) before exp: same value, and exp never overflows.
    return torch.exp(log_w.clamp(max=math.log(cap))).masked_fill(~m, 0.0)


def sampled_entropy(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token entropy of the policy, estimated from the sampled tokens alone: ``[B, T]``.

    Its value is each sampled token's surprisal ``−log π(y_t)`` (an unbiased estimate of the
    entropy of the distribution it was drawn from); its gradient is the score-function estimate
    of the entropy's gradient, ``−log π(y_t)·∇log π(y_t)`` (``∇H = −E[log π(y)·∇log π(y)]``).
    So ``entropy_coef > 0`` in `compute_policy_loss` rewards entropy without the full
    distribution (a trainer that only has the sampled tokens' log-probabilities can use it).
    0 at masked positions.
    """
    m = as_bool_mask(mask, logprobs)
    lp = logprobs.masked_fill(~m, 0.0)
    surprisal = -lp.detach()
    return (surprisal * (1.0 + lp - lp.detach())).masked_fill(~m, 0.0)


def _token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    if advantages.shape == like.shape:
        return advantages.detach()
    if advantages.ndim == 1 and advantages.shape[0] == like.shape[0]:
        return advantages.detach()[:, None].expand(like.shape)
    raise ValueError(
        f"advantages must be [B] or [B, T] = {tuple(like.shape)}, got {tuple(advantages.shape)}"
    )


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    loss_agg: LossAgg = "token-mean",
    max_tokens: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, with the DAPO / Dr.GRPO / TIS / KL options; returns (loss, metrics).

    Per valid token, with ``ρ = exp(logprobs − old_logprobs)`` and advantage ``A``
    (``[B]`` broadcast over the row, or ``[B, T]``)::

        pg = max(−A·ρ, −A·clip(ρ, 1 − clip_eps_low, 1 + clip_eps_high)) · w_TIS

    ``clip_eps_high`` defaults to ``clip_eps_low`` (PPO); DAPO's clip-higher uses 0.2 / 0.28.
    The total loss is ``agg(pg) + kl_coef·agg(KL(π_θ‖π_ref)) − entropy_coef·agg(entropy)``, every
    term aggregated by ``loss_agg`` with the same counts (see ``aggregate_loss`` for the modes,
    ``max_tokens`` and the ``num_tokens`` / ``num_seqs`` gradient-accumulation counts).
    ``old_logprobs``, ``advantages``, ``rollout_logprobs`` and ``ref_logprobs`` are detached.

    Metrics (local to this micro-batch, means over valid tokens):
    ``pg_loss``; ``clip_frac`` (tokens where the clipped term was the active one);
    ``approx_kl`` (k3 estimate of KL(π_old‖π_θ)); ``kl_loss`` when ``kl_coef != 0``;
    ``entropy`` when ``entropy`` is given; ``tis_mean`` (mean applied weight) when TIS is on.
    """
    m = as_bool_mask(mask, logprobs)
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs shape {tuple(old_logprobs.shape)} != {tuple(logprobs.shape)}"
        )
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not 0.0 <= clip_eps_low < 1.0 or eps_high < 0.0:
        raise ValueError(
            f"need 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {clip_eps_low}, {eps_high}"
        )

    def agg(x: Tensor) -> Tensor:
        return aggregate_loss(
            x, m, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, max_tokens=max_tokens
        )

    # Zero-fill before arithmetic so padding garbage reaches neither the loss nor the gradient.
    # Ratios of bf16/fp16 log-probabilities are too coarse near 1 for clipping: work in fp32+.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(dtype).masked_fill(~m, 0.0)
    old = old_logprobs.detach().to(dtype).masked_fill(~m, 0.0)
    adv = _token_advantages(advantages, logprobs).to(dtype).masked_fill(~m, 0.0)
    log_ratio = (lp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    weights: Tensor | None = None
    if tis_cap is not None:
        if rollout_logprobs is None:
            raise ValueError("tis_cap is set but rollout_logprobs is None")
        weights = tis_weights(old, rollout_logprobs.to(dtype), m, cap=tis_cap)
        pg = pg * weights

    pg_loss = agg(pg)
    loss = pg_loss
    kl_term: Tensor | None = None
    if kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs ref_logprobs")
        kl_term = agg(kl_estimate(lp, ref_logprobs.to(dtype), m, kl_estimator))
        loss = loss + kl_coef * kl_term
    if entropy is not None and entropy_coef != 0.0:
        loss = loss - entropy_coef * agg(entropy.to(dtype))

    with torch.no_grad():
        names = ["pg_loss", "clip_frac", "approx_kl"]
        stats = [
            pg_loss.detach(),
            masked_mean((pg_clipped > pg_unclipped).to(lp.dtype), m),
            masked_mean(torch.expm1(log_ratio) - log_ratio, m),
        ]
        if kl_term is not None:
            names.append("kl_loss")
            stats.append(kl_term.detach())
        if entropy is not None:
            names.append("entropy")
            stats.append(masked_mean(entropy.detach(), m))
        if weights is not None:
            names.append("tis_mean")
            stats.append(masked_mean(weights, m))
        values = torch.stack([s.to(torch.float64) for s in stats]).tolist()
    return loss, dict(zip(names, values, strict=True))


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_eps: float | None = 0.2,
    loss_agg: LossAgg = "token-mean",
    max_tokens: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO critic loss ``½·(V − R)²`` per valid token, aggregated by ``loss_agg``.

    With ``clip_eps`` (PPO's value clipping, as in verl/OpenRLHF), the per-token loss is
    ``½·max((V − R)², (V_old + clip(V − V_old, ±clip_eps) − R)²)``; None turns clipping off.
    ``old_values`` and ``returns`` are detached. Metrics: ``vf_loss``, ``vf_clip_frac``
    (tokens where the clipped term was the larger).
    """
    m = as_bool_mask(mask, values)
    if old_values.shape != values.shape or returns.shape != values.shape:
        raise ValueError("values, old_values and returns must have the same [B, T] shape")
    v = values.masked_fill(~m, 0.0)
    r = returns.detach().masked_fill(~m, 0.0)
    unclipped = (v - r).square()
    if clip_eps is None:
        per_token = unclipped
        clipped_active = torch.zeros_like(m)
    else:
        if clip_eps < 0:
            raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
        old = old_values.detach().masked_fill(~m, 0.0)
        v_clipped = old + (v - old).clamp(-clip_eps, clip_eps)
        clipped = (v_clipped - r).square()
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = aggregate_loss(
        0.5 * per_token,
        m,
        loss_agg,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_tokens=max_tokens,
    )
    with torch.no_grad():
        stats = torch.stack(
            [loss.detach().double(), masked_mean(clipped_active.double(), m).double()]
        ).tolist()
    return loss, {"vf_loss": stats[0], "vf_clip_frac": stats[1]}
