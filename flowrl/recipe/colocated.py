"""What colocated placement (``placement.mode = "colocated"``) asks of the rest of a recipe.

A colocated process hosts a trainer and the rollout engine that serves the trainer's own
weights (the hf engine generates with the trainer's module; the vllm engine reloads its own
layout from the module's tensors, in the process), so the two must hold the same model: one
trainer (data-parallel ranks hold shards or replicas that the engine would have to gather), a
real engine (hf or vllm, not sim), whole weights (no adapters), single completions, and every
rollout worker on a node that runs a trainer.
"""

from __future__ import annotations

from flowrl.recipe.model import ModelConfig
from flowrl.recipe.placement import CONTROLLER_NODE, PlacementConfig
from flowrl.recipe.rollout import RolloutConfig
from flowrl.recipe.section import _rule
from flowrl.recipe.trainer import TrainerConfig

__all__ = ["check_colocated"]


def check_colocated(placement: PlacementConfig, *, model: ModelConfig, rollout: RolloutConfig,
                    trainer: TrainerConfig) -> None:
    """Raise a rule error naming the first field colocated placement cannot serve."""
    if placement.mode != "colocated":
        return
    if rollout.engine not in ("hf", "vllm"):
        raise _rule("placement.mode", f"colocated placement serves the trainer's weights on "
                    f"the hf or vllm engine; rollout.engine is {rollout.engine!r}")
    if trainer.ranks != 1:
        raise _rule("trainer.ranks", f"colocated placement runs one trainer, got "
                    f"{trainer.ranks} ranks: ranks hold replicas or shards whose layout "
                    "the rollout engine cannot serve in place (use mode = 'separated')")
    if rollout.workers != trainer.ranks:
        raise _rule("rollout.workers", f"colocated placement hosts one rollout engine in each "
                    f"trainer process: {trainer.ranks} (trainer.ranks), got "
                    f"{rollout.workers}")
    if model.lora is not None:
        raise _rule("model.lora", "colocated placement serves whole trained weights; adapters "
                    "need mode = 'separated'")
    if rollout.episode is not None:
        raise _rule("rollout.episode", "colocated placement serves single completions; "
                    "episodes need mode = 'separated'")
    trainers = placement.roles.get("train", (CONTROLLER_NODE,))
    rollouts = placement.roles.get("rollout", (CONTROLLER_NODE,))
    lonely = sorted(set(rollouts) - set(trainers))
    if lonely or list(rollouts) != list(trainers):
        where = lonely[0] if lonely else rollouts[0]
        raise _rule("placement.roles.rollout", f"colocated placement runs each rollout engine "
                    f"in a trainer process, on the trainer's node: node {where!r} has no "
                    f"trainer (placement.roles.train: {list(trainers)}; name the same nodes "
                    "for both, or leave both out)")
