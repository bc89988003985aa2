"""What colocated placement (``placement.mode = "colocated"``) asks of the rest of a recipe.

A colocated process hosts a trainer (or one data-parallel trainer rank) and a rollout engine
that serves the trainer's weights: the hf engine generates with the trainer's module; the vllm
engine reloads its own layout from the module's tensors, in the process (one trainer only). The
two hold the same model: a real engine (hf or vllm, not sim), whole weights (no adapters),
single completions, one rollout worker per trainer process (``rollout.workers ==
trainer.ranks``), and every rollout worker on a node that runs a trainer. Replicated ranks hold
whole weights, which the engine serves in place; FSDP2 ranks hold shards, so each engine keeps a
whole copy that every step's end loads bucket by bucket (`workers.colocated`).
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
    if rollout.engine == "vllm" and trainer.ranks != 1:
        raise _rule("trainer.ranks", f"colocated placement on vllm runs one trainer, got "
                    f"{trainer.ranks} ranks (data-parallel colocated ranks need "
                    "rollout.engine = 'hf', or use mode = 'separated')")
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
