"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ and PPO's GAE.

Sequence-level estimators (GRPO, Dr.GRPO, RLOO) take ``[B]`` rewards with ``[B]`` group ids (any
id values, any order, variable group sizes, as left by dynamic sampling) or ``[G, n]`` rewards
(one group per row) and return advantages of the same shape; ``compute_policy_loss`` broadcasts a
``[B]`` advantage over each row's tokens. Token-level estimators (REINFORCE++, GAE) take padded
``[B, T]`` tensors with a response mask and return ``[B, T]`` tensors that are 0 where the mask
is 0.

Guarantees: a group whose rewards are all equal (including a group of one) gets advantage exactly
0 from every group estimator; outputs never depend on values at masked positions; no function
here builds an autograd graph (inputs are detached). Imports torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._common import as_bool_mask, flatten_groups, float_dtype, group_stats
from .kl import KLEstimator, kl_estimate


def _centered(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(r − group mean, group std (unbiased), constant-group flag), all per row ``[B]``."""
    flat, ids = flatten_groups(rewards.detach(), group_ids)
    st = group_stats(flat, ids)
    constant = st.constant[st.row_group]
    centered = (flat - st.mean[st.row_group]).masked_fill(constant, 0.0)
    # Unbiased (n−1) std as torch.std, TRL and verl use; a group of one has std 0 by definition.
    var = st.sq_dev / (st.size - 1).clamp(min=1)
    return centered, var.sqrt()[st.row_group], constant


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6
) -> Tensor:
    """GRPO (DeepSeekMath, outcome supervision): ``(r − mean_group) / (std_group + eps)``.

    ``std_group`` is the unbiased sample standard deviation (divisor n − 1), as ``torch.std``
    computes it in TRL's and verl's GRPO. Groups whose rewards are all equal, and groups of one,
    get 0 (verl instead returns the raw reward for a group of one; TRL returns nan).
    """
    centered, std, constant = _centered(rewards, group_ids)
    denom = torch.where(constant, torch.ones_like(std), std + eps)
    return (centered / denom).reshape(rewards.shape)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """Dr.GRPO (Liu et al., 2025): ``r − mean_group``, no std normalization.

    Pair it with ``loss_agg="seq-mean-token-sum-norm"`` and a constant ``max_tokens`` in
    ``compute_policy_loss`` to remove GRPO's length bias as the paper does.
    """
    centered, _, _ = _centered(rewards, group_ids)
    return centered.reshape(rewards.shape)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """RLOO (Ahmadian et al., 2024): ``r_i − mean of the other rewards of the group``.

    Equals ``n/(n−1)·(r_i − mean_group)``. A group of one has no other sample: its advantage is 0.
    """
    flat, ids = flatten_groups(rewards.detach(), group_ids)
    st = group_stats(flat, ids)
    n = st.size[st.row_group]
    others = (st.total[st.row_group] - flat) / (n - 1).clamp(min=1)
    adv = (flat - others).masked_fill(st.constant[st.row_group], 0.0)
    return adv.reshape(rewards.shape)


def expand_to_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """Broadcast a per-sequence ``[B]`` value over each row's valid tokens: ``[B, T]``."""
    if values.ndim != 1 or mask.ndim != 2 or values.shape[0] != mask.shape[0]:
        raise ValueError(
            f"need values [B] and mask [B, T]; got {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    m = mask != 0
    return values.detach()[:, None].expand(m.shape).masked_fill(~m, 0.0)


def masked_whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """``(x − mean) / sqrt(var + eps)`` over the valid tokens of the whole batch.

    ``var`` is the population variance (divisor N, the number of valid tokens), as OpenRLHF's
    REINFORCE++ normalization. Masked positions are 0 in the output.
    """
    m = as_bool_mask(mask, x)
    v = x.detach().to(float_dtype(x)).masked_fill(~m, 0.0)
    n = m.sum().clamp(min=1)
    mean = v.sum() / n
    var = (v - mean).masked_fill(~m, 0.0).square().sum() / n
    return ((v - mean) * torch.rsqrt(var + eps)).masked_fill(~m, 0.0)


def token_level_rewards(
    rewards: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    per_token: Tensor | None = None,
) -> Tensor:
    """Per-token rewards ``[B, T]``: the sequence reward on each row's last valid token (or
    ``per_token`` ``[B, T]`` rewards as given, such as an episode's per-turn ones), minus
    ``kl_coef · kl`` on every valid token (RLHF-style KL penalty in the reward).

    A row with no valid token gets no reward.
    """
    if rewards.ndim != 1 or mask.ndim != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(
            f"need rewards [B] and mask [B, T]; got {tuple(rewards.shape)}, {tuple(mask.shape)}"
        )
    m = mask != 0
    if per_token is not None:
        out = per_token.detach().to(float_dtype(per_token))
    else:
        t = mask.shape[1]
        positions = torch.arange(t, device=mask.device).expand(m.shape)
        last = (torch.where(m, positions, -1).amax(dim=1) if t > 0
                else positions.new_full((0,), -1))
        r = rewards.detach().to(float_dtype(rewards))
        r = torch.where(last >= 0, r, torch.zeros_like(r))
        out = r.new_zeros(m.shape).scatter(1, last.clamp(min=0)[:, None], r[:, None])
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.detach().to(out.dtype).masked_fill(~as_bool_mask(mask, kl), 0.0)
    return out.masked_fill(~m, 0.0)


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """``G_t = Σ_{i ≥ t} γ^(i−t) r_i`` over valid tokens; ``[B, T]``, 0 where masked.

    Masked positions inside a row (e.g. tool-output tokens) are skipped, not counted as steps.
    ``gamma == 1`` is one reverse cumulative sum; otherwise a reverse scan over T, vectorized
    across rows.
    """
    m = as_bool_mask(mask, token_rewards)
    r = token_rewards.detach().to(float_dtype(token_rewards)).masked_fill(~m, 0.0)
    if gamma == 1.0:
        return r.flip(-1).cumsum(-1).flip(-1).masked_fill(~m, 0.0)
    out = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = running
    return out.masked_fill(~m, 0.0)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k1",
    gamma: float = 1.0,
    group_ids: Tensor | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ (Hu, 2025), as in its reference implementation (OpenRLHF):

    1. per-token reward: the sequence reward on the last valid token, minus
       ``kl_coef · KL_t`` on every token, with ``KL_t`` the k1 estimate
       ``old_logprobs − ref_logprobs`` by default (the policy that sampled vs the reference);
    2. return ``G_t = Σ_{i ≥ t} γ^(i−t) r_i`` (γ = 1 by default);
    3. advantage = ``G`` whitened over every valid token of the batch (global batch
       normalization, population variance, ``(G − mean)/sqrt(var + eps)``).

    With ``group_ids``, the group mean reward is subtracted first: the paper's
    "REINFORCE++-baseline" variant for several samples per prompt. Returns ``[B, T]``.
    """
    if group_ids is not None:
        rewards = dr_grpo_advantages(rewards, group_ids)
    kl: Tensor | None = None
    if kl_coef != 0.0:
        if old_logprobs is None or ref_logprobs is None:
            raise ValueError("kl_coef != 0 needs old_logprobs and ref_logprobs")
        kl = kl_estimate(old_logprobs.detach(), ref_logprobs, mask, kl_estimator)
    token_rewards = token_level_rewards(rewards, mask, kl=kl, kl_coef=kl_coef)
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, eps=eps)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """PPO's generalized advantage estimation (Schulman et al., 2016).

    ``δ_t = r_t + γ·V_{t+1} − V_t`` (``V`` after the last valid token is 0) and
    ``A_t = δ_t + γλ·A_{t+1}``, a reverse scan over T vectorized across rows. Masked positions
    inside a row are skipped (the next valid token's value and advantage carry across them).
    Returns ``(advantages, returns)`` with ``returns = A + V`` computed before whitening (the
    critic's target); ``whiten`` normalizes the advantages over the batch's valid tokens as
    ``masked_whiten`` does. Both outputs are 0 where the mask is 0. Build ``token_rewards``
    with ``token_level_rewards``.
    """
    m = as_bool_mask(mask, token_rewards)
    if values.shape != token_rewards.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != {tuple(token_rewards.shape)}")
    dtype = float_dtype(token_rewards)
    r = token_rewards.detach().to(dtype).masked_fill(~m, 0.0)
    v = values.detach().to(dtype).masked_fill(~m, 0.0)
    adv = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        next_adv = torch.where(valid, a_t, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        adv[:, t] = a_t
    adv = adv.masked_fill(~m, 0.0)
    returns = (adv + v).masked_fill(~m, 0.0)
    if whiten:
        adv = masked_whiten(adv, m, eps=eps)
    return adv, returns
