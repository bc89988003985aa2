"""One micro-batch of the train stage as the trainer reads it from the store."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from workers.engines.protocols import SequenceBatch

__all__ = ["TrainBatch"]


@dataclass(frozen=True)
class TrainBatch:
    """One micro-batch, tensors on the CPU: the sequences and the loss's per-row inputs."""

    seqs: SequenceBatch
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] int64
    rollout_logprobs: Tensor  # [B, L] float32, 0 off the response
    ref_logprobs: Tensor | None  # [B, L] float32, 0 off the response
    advantages: Tensor | None = None  # [B, L] float32 from the critic (PPO), 0 off the response
    #: [B, L] int32: the policy version of each trained token (episodes record it), else None
    token_versions: Tensor | None = None

    @classmethod
    def from_inputs(
        cls, inputs: Mapping[str, Sequence[Any]], row_groups: Sequence[int], *, pad_token_id: int
    ) -> TrainBatch:
        """From a train task's inputs (store tensors are only read, never written). With a
        ``loss_mask`` (multi-turn episodes), only the policy's own tokens are trained; every
        per-token input is aligned with ``response_ids``."""
        seqs = SequenceBatch.from_rows(inputs["prompt_ids"], inputs["response_ids"],
                                       pad_token_id=pad_token_id,
                                       loss_masks=inputs.get("loss_mask"))
        ref = inputs.get("ref_logprobs")
        adv = inputs.get("advantages")
        versions = inputs.get("token_versions")
        return cls(
            seqs=seqs,
            rewards=torch.tensor([float(r) for r in inputs["reward"]], dtype=torch.float32),
            group_ids=torch.tensor([int(g) for g in row_groups], dtype=torch.int64),
            rollout_logprobs=seqs.per_token(inputs["rollout_logprobs"], "rollout_logprobs"),
            ref_logprobs=None if ref is None else seqs.per_token(ref, "ref_logprobs"),
            advantages=None if adv is None else seqs.per_token(adv, "advantages"),
            token_versions=None if versions is None else
            seqs.per_token(versions, "token_versions").to(torch.int32),
        )

    @property
    def num_tokens(self) -> int:
        return self.seqs.num_response_tokens

    @property
    def num_seqs(self) -> int:
        """Rows with at least one response token (the seq-mean modes count only those)."""
        return int(self.seqs.response_mask.any(dim=-1).sum())
