"""The ``sim`` section: modelled costs of simulated workers."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, model_validator

from flowrl.recipe.section import _rule, _Section

#: the fields of the episode cost model, used only with ``episode_turns > 0``
_EPISODE_FIELDS = ("tool_s", "tool_tokens", "decode_row_s", "max_running")


class SimConfig(_Section):
    """Modelled costs of simulated workers (``rollout.engine="sim"``); see ``workers.sim``.

    Mirrors ``workers.sim.SimCost`` except its length cap, which is `RolloutConfig.max_new_tokens`,
    and ``partial``, which is `RolloutConfig.partial`.
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
    weight_load_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    """Time a rollout worker takes to load a new version."""
    episode_turns: int = Field(default=0, ge=0, le=1024)
    """Multi-turn episodes (``workers.sim_episode``): each response is an episode of 1 to this
    many turns (uniform), every turn but the last ending with a tool call, run by the real
    episode rollout role on a decode loop of modelled cost, so ``rollout.partial`` applies.
    Each turn's length is drawn as a response's (`log_mean`, `log_sigma`); `rollout_base_s` is
    then the cost of one prefill and `rollout_token_s` of one decode step. 0: single-turn
    groups."""
    tool_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    """Latency of one tool call (episodes only)."""
    tool_tokens: int = Field(default=0, ge=0, le=1 << 20)
    """Tokens a tool call's result inserts into the trajectory (episodes only)."""
    decode_row_s: float = Field(default=0.0, ge=0.0, le=60.0)
    """Decode-step cost per running sequence, on top of `rollout_token_s` (episodes only)."""
    max_running: int = Field(default=256, ge=1, le=1 << 20)
    """Sequences a rollout worker's running batch holds at most (episodes only)."""
    trace: str | None = None
    """A recorded run's trace file (``--record-trace``): task times, response lengths and weight
    loads are drawn from it instead of the costs above (``python -m flowrl.plan`` sets it)."""
    trace_stretch: (Annotated[float, Field(gt=0.0, le=1000.0)]
                    | dict[str, Annotated[float, Field(gt=0.0, le=1000.0)]]) = 1.0
    """Multiplies every time drawn from ``trace`` (the planner's CPU-contention factor): one
    factor, or one per role (a role not named keeps its times)."""

    @model_validator(mode="after")
    def _episode_fields(self) -> SimConfig:
        if self.episode_turns == 0:
            given = [f for f in _EPISODE_FIELDS if f in self.model_fields_set]
            if given:
                raise _rule(given[0], "models episodes: set episode_turns > 0 (it is 0, "
                            "single-turn groups)")
        return self
