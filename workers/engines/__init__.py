"""Compute engines behind narrow protocols: rollout (generate, load weights) and trainer
(logprobs, micro-batch training, optimizer step, export weights).

The protocols and their value types import only torch. The built-in engines import
transformers, so they load on first access (``from workers.engines import HFRolloutEngine``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.engines.protocols import (
    FinishReason,
    Generation,
    LossFn,
    RolloutEngine,
    SamplingParams,
    SequenceBatch,
    TrainerEngine,
    TrainerState,
    token_logprobs,
)

if TYPE_CHECKING:
    from workers.engines.hf_rollout import HFRolloutEngine
    from workers.engines.torch_trainer import TorchTrainerEngine

__all__ = [
    "FinishReason",
    "Generation",
    "HFRolloutEngine",
    "LossFn",
    "RolloutEngine",
    "SamplingParams",
    "SequenceBatch",
    "TorchTrainerEngine",
    "TrainerEngine",
    "TrainerState",
    "token_logprobs",
]

_LAZY = {
    "HFRolloutEngine": "workers.engines.hf_rollout",
    "TorchTrainerEngine": "workers.engines.torch_trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
