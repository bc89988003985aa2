"""Which of a model's weights are one tensor under several names (tied embeddings and heads)."""

from __future__ import annotations

import torch

__all__ = ["tied_groups"]


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """State-dict names grouped by the tensor they share (a tied weight has several names)."""
    groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault((tensor.data_ptr(), tuple(tensor.shape)), []).append(name)
    return list(groups.values())
