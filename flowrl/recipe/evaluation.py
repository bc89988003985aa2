"""The ``eval`` section: periodic validation on held-out prompts.

Every ``every`` steps, and after the last one, rollout workers answer the held-out prompts with
the weights of that step, greedily and by sampling at the rollout temperature, and reward
workers score the answers with the run's reward. The step log, the progress output, the
summary and the dashboard show ``eval/greedy_accuracy``, ``eval/sampled_accuracy`` and the mean
rewards (`flowrl.control.evaluation` says how the work is scheduled). The held-out prompts are
never trained on (`flowrl.data.hold_out`).
"""

from __future__ import annotations

from pydantic import Field

from flowrl.recipe.section import _PathText, _Section


class EvalConfig(_Section):
    """When and on what the policy is evaluated."""

    every: int = Field(ge=1, le=10**9)
    """Evaluate after every this many steps (and after the last step)."""
    prompts: int = Field(default=32, ge=1, le=10**6)
    """Held-out prompts: the first this many distinct prompts of ``path``, or, without it,
    this many prompts of the training data (drawn with the run's seed), which training then
    leaves out."""
    path: _PathText | None = None
    """A file of held-out rows, of ``data.kind`` (``jsonl`` or ``parquet``) and read with the
    same keys and template; prompts found in it are left out of training too."""
    sampled: int = Field(default=4, ge=0, le=1024)
    """Responses sampled per prompt at the rollout temperature (``eval/sampled_accuracy``);
    0 evaluates greedily only."""
    correct_reward: float = 1.0
    """A response counts as correct when its reward is at least this (the built-in rewards
    give 1.0 for an exact answer)."""
    prompts_per_task: int = Field(default=8, ge=1, le=4096)
    """Held-out prompts one rollout task answers: small tasks interleave with training's."""
