"""Several optimizer updates per global batch (PPO's epochs and mini-batches), for the train role.

With ``ppo_epochs > 1`` or more than one mini-batch per pass, `workers.roles.trainer` keeps each
micro-batch of a step as a `KeptBatch` when it arrives: its sequences, its log-probabilities
under the policy before the step's first update (π_old, computed once, with no gradient) and its
advantages (computed from π_old when the KL is in the rewards). At the step's end it runs
``ppo_epochs`` passes; each pass is `mini_batch_runs` of the kept micro-batches, one optimizer
update per run. π_old stays fixed over all of them, so from the second update on the importance
ratio π_θ/π_old moves away from 1 and the policy loss's clip binds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from flowrl.algorithms import RolloutCorrection
from workers.roles.train_batch import TrainBatch

__all__ = ["KeptBatch", "mini_batch_runs"]


@dataclass(frozen=True)
class KeptBatch:
    """A micro-batch kept for the step's updates; tensors on the CPU."""

    batch: TrainBatch
    old_logprobs: Tensor  # [B, L] π_old, 0 off the response
    advantages: Tensor  # [B] or [B, L]
    correction: RolloutCorrection | None  # the rollout correction of its task


def mini_batch_runs(rows: Sequence[int], parts: int) -> list[slice]:
    """Split micro-batches of ``rows`` rows each, in order, into at most ``parts`` contiguous
    runs of about equal rows (exactly equal when the micro-batches are alike and ``parts``
    divides their number); fewer runs when there are fewer micro-batches than ``parts``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    runs: list[slice] = []
    total, start, done = sum(rows), 0, 0
    for i, n in enumerate(rows):
        done += n
        # Close a run once it reaches its share of the rows (cumulative, so errors never add up).
        if done * parts >= total * (len(runs) + 1) or i == len(rows) - 1:
            runs.append(slice(start, i + 1))
            start = i + 1
    return runs
