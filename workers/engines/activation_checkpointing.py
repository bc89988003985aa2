"""Activation checkpointing of a transformers model's decoder layers.

transformers' own switch (``gradient_checkpointing_enable``) acts only in training mode, and
flowrl's models stay in eval mode for good (dropout off: rollout, scoring and training compute
one function). So each decoder layer's forward is wrapped here instead: while gradients are
being recorded it runs under non-reentrant `torch.utils.checkpoint.checkpoint`, which keeps
only the layer's inputs and recomputes the rest during the backward pass. The RNG state is
replayed, so a recomputed dropout mask is the one of the forward; loss and gradients are the
same as without.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_layers"]


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Checkpoint every module of a class the model names in ``_no_split_modules`` (its
    decoder layers); returns how many. ValueError when the model names none."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    count = 0
    for module in model.modules():
        if module is not model and type(module).__name__ in layers:
            module.forward = _checkpointed(module.forward)  # type: ignore[method-assign]
            count += 1
    if not count:
        raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} names no "
                         "decoder layers (_no_split_modules) to checkpoint")
    return count


def _checkpointed(forward: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
