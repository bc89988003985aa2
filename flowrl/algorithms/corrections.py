"""Rollout corrections: weights for samples drawn from another policy than the one the loss's
ratio is taken against.

A row generated ``s`` versions ago was drawn from the rollout policy (an older version, and the
rollout engine's numerics), not from the policy that computed ``old_logprobs``. The policy loss
multiplies each token's loss by a detached weight built from the per-token log-ratio
``δ_t = old_logprobs − rollout_logprobs`` (``ρ_t = exp(δ_t) = π_old(y_t)/π_rollout(y_t)``), or
from a row's sequence ratio ``ρ = exp(Σ_t δ_t)`` over its valid tokens:

=========== ========= ===========================================================
kind        level     weight
=========== ========= ===========================================================
``tis``     token     ``min(ρ_t, cap)`` — truncated importance sampling
``seq_tis`` sequence  ``min(ρ, cap)`` on every token of the row
``mis``     sequence  ``ρ`` where ``low ≤ ρ ≤ high``, else 0: the row is dropped (masked
                      importance sampling)
``icepop``  token     ``ρ_t`` where ``low ≤ ρ_t ≤ high``, else 0: the token is dropped
                      (IcePop)
=========== ========= ===========================================================

Truncation keeps every sample and bounds its weight (biased, low variance); masking rejects the
samples that are too far off-policy and weights the rest exactly. The sequence ratio is the
probability ratio of the whole response, so the sequence kinds correct the sample as drawn; it
drifts further from 1 the longer the response, so ``mis`` rejects long stale rows more often
(watch ``is_masked_frac``).

Defaults: ``cap = 2.0`` and bounds ``[0.5, 2.0]`` (symmetric in log-ratio). A recipe turns the
correction on while ``max_staleness > 0`` (`default_tis_cap`); it also corrects the rollout
engine's numerical mismatch at staleness 0 if one asks for it. Imports torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ._common import as_bool_mask

CorrectionKind = Literal["tis", "seq_tis", "mis", "icepop"]
CORRECTION_KINDS: tuple[CorrectionKind, ...] = ("tis", "seq_tis", "mis", "icepop")
#: the kinds that drop samples (bounds) rather than truncate their weights (cap).
MASKING_KINDS: tuple[CorrectionKind, ...] = ("mis", "icepop")

DEFAULT_TIS_CAP = 2.0
DEFAULT_MASK_BOUNDS = (0.5, 2.0)


def default_tis_cap(max_staleness: int) -> float | None:
    """The TIS cap a recipe should use: ``DEFAULT_TIS_CAP`` when samples may be stale, else None."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return DEFAULT_TIS_CAP if max_staleness > 0 else None


@dataclass(frozen=True)
class RolloutCorrection:
    """One correction: its ``kind``, the ``cap`` of the truncating kinds and the ``bounds``
    ``(low, high)`` of the masking kinds (the other is ignored). Validated on construction."""

    kind: CorrectionKind = "tis"
    cap: float = DEFAULT_TIS_CAP
    bounds: tuple[float, float] = DEFAULT_MASK_BOUNDS

    def __post_init__(self) -> None:
        if self.kind not in CORRECTION_KINDS:
            raise ValueError(f"unknown correction {self.kind!r}; expected one of "
                             f"{CORRECTION_KINDS}")
        if not (self.cap > 0 and math.isfinite(self.cap)):
            raise ValueError(f"TIS cap must be positive, got {self.cap}")
        low, high = self.bounds
        # Ratio 1 (a token the rollout policy drew exactly as π_old would) is always kept.
        if not (0.0 <= low <= 1.0 <= high and low < high and math.isfinite(high)):
            raise ValueError(f"mask bounds must satisfy 0 <= low <= 1 <= high < inf and "
                             f"low < high, got {self.bounds}")

    @property
    def masks(self) -> bool:
        """Whether this kind drops samples (``mis``, ``icepop``)."""
        return self.kind in MASKING_KINDS


def _log_ratios(old_logprobs: Tensor, rollout_logprobs: Tensor, m: Tensor) -> Tensor:
    """Detached ``old − rollout`` per token, 0 at masked positions (padding never read)."""
    if rollout_logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} != {tuple(old_logprobs.shape)}"
        )
    old = old_logprobs.detach().masked_fill(~m, 0.0)
    return old - rollout_logprobs.detach().to(old.dtype).masked_fill(~m, 0.0)


def correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, correction: RolloutCorrection
) -> tuple[Tensor, Tensor]:
    """Detached per-token weights ``[B, T]`` of ``correction`` (see the module docstring) and
    the bool ``[B, T]`` of valid tokens it dropped (all False for the truncating kinds).

    Weights are 0 at masked positions and at dropped tokens.
    """
    m = as_bool_mask(mask, old_logprobs)
    log_w = _log_ratios(old_logprobs, rollout_logprobs, m)
    if correction.kind in ("seq_tis", "mis"):
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
    if correction.masks:
        low, high = correction.bounds
        keep = log_w <= math.log(high)
        if low > 0.0:
            keep &= log_w >= math.log(low)
        dropped = m & ~keep
        # min(log_w, log high) before exp: the same value where kept, and exp never overflows.
        weights = torch.exp(log_w.clamp(max=math.log(high))).masked_fill(~m | dropped, 0.0)
        return weights, dropped
    weights = torch.exp(log_w.clamp(max=math.log(correction.cap))).masked_fill(~m, 0.0)
    return weights, torch.zeros_like(m)


def tis_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float = DEFAULT_TIS_CAP
) -> Tensor:
    """Detached per-token weights ``min(exp(old_logprobs − rollout_logprobs), cap)``.

    0 at masked positions.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be positive, got {cap}")
    weights, _ = correction_weights(
        old_logprobs, rollout_logprobs, mask, RolloutCorrection("tis", cap=cap)
    )
    return weights
