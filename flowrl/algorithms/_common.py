"""Masked reductions, loss aggregation and per-group statistics shared by the algorithms.

Conventions (all public functions of `flowrl.algorithms` follow them):

- Token tensors are padded ``[B, T]``; the response mask is ``[B, T]`` bool or float, where any
  non-zero entry marks a valid token (weights other than 0/1 are not supported).
- Values at masked positions are never read: inputs are zero-filled there before any arithmetic,
  so padding may hold anything (``-inf``, ``nan``) without poisoning results or gradients.
- Groups are a ``[B]`` integer tensor of group ids (any values, any order, variable sizes); the
  statistics are computed with scatter/index ops, never a Python loop over rows.

Imports torch only.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[LossAgg, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def as_bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    """Return ``mask`` as a bool tensor, checking that it has the shape of ``like``."""
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def float_dtype(x: Tensor) -> torch.dtype:
    """The dtype arithmetic on ``x`` runs in: its own if floating, else float32."""
    return x.dtype if x.is_floating_point() else torch.float32


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set; 0 when no position is set."""
    m = as_bool_mask(mask, x)
    total = x.masked_fill(~m, 0.0).sum()
    return total / m.sum().clamp(min=1)


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: LossAgg = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:

    - ``"token-mean"`` (DAPO): sum over every valid token of the batch / number of valid tokens.
      Long sequences weigh in proportion to their length.
    - ``"seq-mean-token-mean"`` (original GRPO): mean over each row's valid tokens, then mean
      over rows.
    - ``"seq-mean-token-sum-norm"`` (Dr.GRPO): each row's token sum divided by the constant
      ``max_tokens``, then mean over rows. Pass the generation budget (max new tokens) as
      ``max_tokens`` so the divisor is the same for every micro-batch; it defaults to ``T``, the
      padded width, which is constant only when every batch is padded to the same width.

    Rows with no valid token are not counted in the seq-mean modes. For gradient accumulation,
    pass the whole mini-batch's count as ``num_tokens`` (token-mean) or ``num_seqs`` (seq-mean
    modes): the micro-batch losses then *sum* to the exact mini-batch loss. (Under data-parallel
    gradient averaging, also multiply by the world size, or count over all ranks and sum.)
    """
    m = as_bool_mask(mask, loss_mat)
    if loss_mat.ndim != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    if (num_tokens is not None and num_tokens <= 0) or (num_seqs is not None and num_seqs <= 0):
        raise ValueError(f"num_tokens / num_seqs must be positive, got {num_tokens}, {num_seqs}")
    values = loss_mat.masked_fill(~m, 0.0)
    if mode == "token-mean":
        token_denom = m.sum().clamp(min=1) if num_tokens is None else num_tokens
        return values.sum() / token_denom
    tokens_per_row = m.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = values.sum(dim=-1) / tokens_per_row.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        divisor = loss_mat.shape[-1] if max_tokens is None else max_tokens
        if divisor <= 0:
            raise ValueError(f"max_tokens must be positive, got {divisor}")
        per_row = values.sum(dim=-1) / divisor
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGG_MODES}")
    seq_denom = (tokens_per_row > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    return per_row.sum() / seq_denom


class GroupStats(NamedTuple):
    """Per-group statistics of a ``[B]`` value tensor; index ``[G]`` tensors by ``row_group``."""

    ids: Tensor  # [G] the distinct group ids, sorted
    row_group: Tensor  # [B] dense group index (0..G-1) of every row
    size: Tensor  # [G] rows per group (float)
    total: Tensor  # [G] sum of values
    mean: Tensor  # [G]
    spread: Tensor  # [G] max − min
    sq_dev: Tensor  # [G] sum of squared deviations from the group mean

    @property
    def constant(self) -> Tensor:
        """[G] bool: every value of the group is equal (always true for a group of one)."""
        return self.spread == 0


def flatten_groups(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Accept ``[B]`` rewards with ``[B]`` group ids, or ``[G, n]`` rewards (row = group).

    Returns flat ``[B]`` float rewards and ``[B]`` group ids.
    """
    if group_ids is None:
        if rewards.ndim != 2:
            raise ValueError("without group_ids, rewards must be [G, n] (one group per row)")
        g, n = rewards.shape
        ids = torch.arange(g, device=rewards.device).repeat_interleave(n)
        return rewards.reshape(-1).to(float_dtype(rewards)), ids
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    return rewards.to(float_dtype(rewards)), group_ids


def group_stats(values: Tensor, group_ids: Tensor) -> GroupStats:
    """Two-pass (numerically stable) per-group size, sum, mean, spread and squared deviation."""
    ids, index = torch.unique(group_ids, sorted=True, return_inverse=True)
    g = ids.numel()
    zeros = values.new_zeros(g)
    count = zeros.index_add(0, index, torch.ones_like(values))
    total = zeros.index_add(0, index, values)
    mean = total / count.clamp(min=1)
    gmax = zeros.scatter_reduce(0, index, values, reduce="amax", include_self=False)
    gmin = zeros.scatter_reduce(0, index, values, reduce="amin", include_self=False)
    sq_dev = zeros.index_add(0, index, (values - mean[index]).square())
    return GroupStats(ids, index, count, total, mean, gmax - gmin, sq_dev)
