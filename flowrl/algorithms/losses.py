"""Policy and value losses: three policy objectives, rollout corrections for stale samples, the
KL-to-reference term, an entropy bonus, and PPO's clipped value loss.

``compute_policy_loss`` is the one entry the trainer calls per micro-batch. It returns a scalar
loss whose gradient reaches ``logprobs`` (and ``entropy`` when an entropy bonus is set) only at
valid tokens, and a dict of plain floats for logging (one device sync for all of them).

Policy objectives (``policy_loss``), with ``ρ_t = π_θ(y_t)/π_old(y_t)`` and advantage ``A``:

- ``"ppo_clip"``: PPO's clipped surrogate per token, ``max(−A·ρ_t, −A·clip(ρ_t, 1−ε_low,
  1+ε_high))``; DAPO's clip-higher is ``ε_high > ε_low`` (0.2 / 0.28). Default ε: 0.2 / 0.2.
- ``"gspo"`` (GSPO, Zheng et al., 2025): one ratio per sequence, the geometric mean
  ``s_i = exp(mean_t log ρ_t)`` over its valid tokens, clipped at sequence level; the loss of
  sequence i is ``−min(s_i·A_i, clip(s_i, 1−ε_low, 1+ε_high)·A_i)``. It is computed in the
  GSPO-token form ``s_i,t = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)]``, whose value is ``s_i`` on every token
  and whose gradient is the paper's (``s_i·A_i/|y_i|·Σ_t ∇log π_θ(y_t)`` per unclipped sequence),
  and which also takes per-token advantages. Aggregated with ``seq-mean-token-mean`` the loss is
  exactly the paper's ``1/G·Σ_i`` of the sequence losses. Default ε: the paper's 3e-4 / 4e-4
  (a sequence ratio is a geometric mean, so it moves far less than a token's).
- ``"cispo"`` (CISPO, MiniMax-M1): clips the importance-sampling *weight* instead of the update:
  ``−sg(clip(ρ_t, 1−ε_low, 1+ε_high))·A·log π_θ(y_t)`` per token. Every token keeps its
  gradient, the clipped ones with a bounded weight. Default ε: 1.0 / 0.28 (no lower bound, as
  the paper; its tuned upper bound is not published, 0.28 is DAPO's clip-higher).

With one update per batch (``old_logprobs = logprobs.detach()``, the trainer's default) every ρ is
1, no clip binds, and the three give every token the same gradient ``−A·∇log π_θ`` before
aggregation (GSPO's default aggregation is then its only difference); they differ once π_θ has
moved away from π_old, as in several updates per batch (``trainer.ppo_epochs``,
``mini_batch_groups``).

Rollout corrections (``correction`` or ``tis_cap``) multiply every token's loss by a detached
weight for the gap between π_old and the policy that generated the sample (stale rows, the
rollout engine's numerics): token- or sequence-level truncated importance sampling (``tis``,
``seq_tis``) or masking (``mis``, ``icepop``); see `flowrl.algorithms.corrections`. The recipe
layer turns them on, by default while ``max_staleness > 0`` (`default_tis_cap`). Imports torch
only.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ._common import LossAgg, aggregate_loss, as_bool_mask, masked_mean
from .corrections import RolloutCorrection, correction_weights
from .kl import KLEstimator, kl_estimate

PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
#: (ε_low, ε_high) of each policy objective when the caller gives none; PPO's ε_high defaults to
#: the ε_low in use (symmetric clipping).
CLIP_DEFAULTS: dict[PolicyLoss, tuple[float, float]] = {
    "ppo_clip": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
}
# |log ratio| beyond this is far outside any clip range; clamping keeps exp() finite (as verl).
_MAX_LOG_RATIO = 20.0


def clip_range(
    policy_loss: PolicyLoss, clip_eps_low: float | None = None, clip_eps_high: float | None = None
) -> tuple[float, float]:
    """The (ε_low, ε_high) ``policy_loss`` uses: the given ones, else its `CLIP_DEFAULTS`.

    A ``ppo_clip`` without ``clip_eps_high`` clips symmetrically at ``clip_eps_low``.
    """
    if policy_loss not in CLIP_DEFAULTS:
        raise ValueError(f"unknown policy loss {policy_loss!r}; expected one of "
                         f"{tuple(CLIP_DEFAULTS)}")
    default_low, default_high = CLIP_DEFAULTS[policy_loss]
    low = default_low if clip_eps_low is None else clip_eps_low
    if clip_eps_high is not None:
        high = clip_eps_high
    else:
        high = low if policy_loss == "ppo_clip" else default_high
    # ε_low = 1 puts the lower bound at ratio 0: no lower clip (CISPO's default).
    if not 0.0 <= low <= 1.0 or high < 0.0:
        raise ValueError(f"need 0 <= clip_eps_low <= 1 and clip_eps_high >= 0, got {low}, {high}")
    return low, high


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
    policy_loss: PolicyLoss = "ppo_clip",
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    loss_agg: LossAgg | None = None,
    max_tokens: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    correction: RolloutCorrection | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The ``policy_loss`` objective with a rollout correction, KL term and entropy bonus;
    returns (loss, metrics).

    Per valid token, with advantage ``A`` (``[B]`` broadcast over the row, or ``[B, T]``),
    ``pg`` is the objective's token loss (module docstring) times the correction's weight.
    ``clip_eps_low`` / ``clip_eps_high`` default to the objective's (`clip_range`). The total
    loss is ``agg(pg) + kl_coef·agg(KL(π_θ‖π_ref)) − entropy_coef·agg(entropy)``, every term
    aggregated by ``loss_agg`` with the same counts (see ``aggregate_loss`` for the modes,
    ``max_tokens`` and the ``num_tokens`` / ``num_seqs`` gradient-accumulation counts);
    ``loss_agg`` defaults to ``seq-mean-token-mean`` for GSPO (the paper's objective) and to
    ``token-mean`` otherwise.
    ``old_logprobs``, ``advantages``, ``rollout_logprobs`` and ``ref_logprobs`` are detached.

    The correction is ``correction``, or token-level TIS capped at ``tis_cap`` (the shorthand
    for ``RolloutCorrection("tis", cap=tis_cap)``; not both); either needs
    ``rollout_logprobs``. None of them: no correction.

    Metrics (local to this micro-batch, means over valid tokens):
    ``pg_loss``; ``clip_frac`` (tokens whose clipped term was the active one; for GSPO the
    tokens of clipped sequences, for CISPO the tokens whose weight was clipped);
    ``approx_kl`` (k3 estimate of KL(π_old‖π_θ)); ``kl_loss`` when ``kl_coef != 0``;
    ``entropy`` when ``entropy`` is given; with a correction ``tis_mean`` (the mean applied
    weight, dropped tokens counting 0), and for the masking kinds ``is_masked_frac`` (the
    tokens dropped).
    """
    m = as_bool_mask(mask, logprobs)
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if old_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"old_logprobs shape {tuple(old_logprobs.shape)} != {tuple(logprobs.shape)}"
        )
    eps_low, eps_high = clip_range(policy_loss, clip_eps_low, clip_eps_high)
    if loss_agg is None:
        loss_agg = "seq-mean-token-mean" if policy_loss == "gspo" else "token-mean"
    if tis_cap is not None:
        if correction is not None:
            raise ValueError("give tis_cap or correction, not both")
        correction = RolloutCorrection("tis", cap=tis_cap)
    if correction is not None and rollout_logprobs is None:
        raise ValueError(f"correction {correction.kind!r} (tis_cap) needs rollout_logprobs")

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
    pg, clipped = _objective(policy_loss, lp, log_ratio, adv, m, eps_low, eps_high)

    weights: Tensor | None = None
    dropped: Tensor | None = None
    if correction is not None:
        assert rollout_logprobs is not None  # checked above
        weights, dropped = correction_weights(old, rollout_logprobs.to(dtype), m, correction)
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
            masked_mean(clipped.to(lp.dtype), m),
            masked_mean(torch.expm1(log_ratio) - log_ratio, m),
        ]
        if kl_term is not None:
            names.append("kl_loss")
            stats.append(kl_term.detach())
        if entropy is not None:
            names.append("entropy")
            stats.append(masked_mean(entropy.detach(), m))
        if weights is not None and correction is not None and dropped is not None:
            names.append("tis_mean")
            stats.append(masked_mean(weights, m))
            if correction.masks:
                names.append("is_masked_frac")
                stats.append(masked_mean(dropped.to(lp.dtype), m))
        values = torch.stack([s.to(torch.float64) for s in stats]).tolist()
    return loss, dict(zip(names, values, strict=True))


def _objective(
    policy_loss: PolicyLoss, lp: Tensor, log_ratio: Tensor, adv: Tensor, m: Tensor,
    eps_low: float, eps_high: float,
) -> tuple[Tensor, Tensor]:
    """The objective's per-token loss ``[B, T]`` and where its clip was active (bool).

    ``lp``, ``log_ratio`` and ``adv`` are zero-filled at masked positions.
    """
    if policy_loss == "cispo":
        ratio = torch.exp(log_ratio.detach())
        weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        return -adv * weight * lp, (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
    if policy_loss == "gspo":
        # log s_i: the mean of the row's token log-ratios (0 for a row with no valid token).
        count = m.sum(dim=-1, keepdim=True).clamp(min=1)
        log_seq = (log_ratio.sum(dim=-1, keepdim=True) / count).detach()
        # GSPO-token: value s_i on every token, gradient s_i·∇log π_θ(y_t) on each.
        ratio = torch.exp(log_seq + lp - lp.detach())
    else:
        ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(pg_unclipped, pg_clipped), pg_clipped > pg_unclipped


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
