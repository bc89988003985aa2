"""The ``critic`` section: PPO's value model."""

from __future__ import annotations

from pydantic import Field

from flowrl.recipe.section import _Section


class CriticConfig(_Section):
    """PPO's value model (``algorithm.name="ppo"``): the policy's backbone plus a scalar head.

    One critic worker scores every row (values, GAE advantages, returns) and learns from them,
    one AdamW step per ``trainer.groups_per_step * algorithm.group_size`` rows it has scored
    (see ``workers.roles.critic``). It is a single worker because its weights are state: two
    independent critics would each see part of the rows and disagree."""

    lr: float = Field(default=1e-5, gt=0.0, le=1.0)
    """Learning rate of the critic (constant)."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """AdamW decoupled weight decay (matrices only)."""
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip of the critic; None disables it."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """GAE discount per response token."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0)
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors."""
    value_clip: float | None = Field(default=0.2, gt=0.0)
    """PPO value clip around the values a row was scored with; binds only in passes after the
    first (`epochs` > 1). None turns it off."""
    epochs: int = Field(default=1, ge=1, le=64)
    """Critic passes (and optimizer steps) per batch; passes after the first replay the batch
    kept in the critic's memory."""
    threads: int = Field(default=1, ge=1, le=1024)
    """torch threads of the critic process."""
