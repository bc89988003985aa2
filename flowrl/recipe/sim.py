"""The ``sim`` section: modelled costs of simulated workers."""

from __future__ import annotations

import math

from pydantic import Field

from flowrl.recipe.section import _Section


class SimConfig(_Section):
    """Modelled costs of simulated workers (``rollout.engine="sim"``); see ``workers.sim``.

    Mirrors ``workers.sim.SimCost`` except its length cap, which is `RolloutConfig.max_new_tokens`.
    """

    prompt_len: int = Field(default=64, ge=1, le=1 << 20)
    """Tokens per simulated prompt."""
    log_mean: float = Field(default=math.log(96), ge=0.0, le=20.0)
    """Mean of log(response length)."""
    log_sigma: float = Field(default=1.0, ge=0.0, le=10.0)
    """Standard deviation of log(response length)."""
    rollout_base_s: float = Field(default=0.002, ge=0.0)
    """Fixed cost of generating one group."""
    rollout_token_s: float = Field(default=0.0001, ge=0.0)
    """Decode cost per token of a group's longest response."""
    reward_token_s: float = Field(default=0.000002, ge=0.0)
    """Reward cost per response token."""
    reference_token_s: float = Field(default=0.00001, ge=0.0)
    """Reference-model cost per response token."""
    train_token_s: float = Field(default=0.00001, ge=0.0)
    """Forward+backward cost per response token."""
    train_step_s: float = Field(default=0.01, ge=0.0)
    """Optimizer step cost."""
    critic_token_s: float = Field(default=0.00001, ge=0.0)
    """Critic cost per response token (values, GAE and its own backward; PPO only)."""
    weight_numel: int = Field(default=1 << 16, ge=1, le=1 << 34)
    """float32 weights published after each step (weight-sync traffic)."""
    trace: str | None = None
    """A recorded run's trace file (``--record-trace``): task times, response lengths and weight
    loads are drawn from it instead of the costs above (``python -m flowrl.plan`` sets it)."""
    trace_stretch: float = Field(default=1.0, gt=0.0, le=1000.0)
    """Multiplies every time drawn from ``trace`` (the planner's CPU-contention factor)."""
