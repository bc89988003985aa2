"""The cost model of simulated roles (`workers.sim`, `workers.sim_episode`), apart from both so
that neither imports the other for it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SimCost"]


@dataclass(frozen=True)
class SimCost:
    prompt_len: int = 64
    max_new_tokens: int = 512
    log_mean: float = math.log(96)
    log_sigma: float = 1.0
    rollout_base_s: float = 0.002
    rollout_token_s: float = 0.0001
    reward_token_s: float = 0.000002
    reference_token_s: float = 0.00001
    train_token_s: float = 0.00001
    train_step_s: float = 0.01
    critic_token_s: float = 0.00001
    weight_numel: int = 1 << 16
    #: time a rollout worker takes to load a new version (to model slow or stuck syncs).
    weight_load_s: float = 0.0
    #: multi-turn episodes (``workers.sim_episode``): at most this many turns; 0: single turn
    episode_turns: int = 0
    tool_s: float = 0.0
    tool_tokens: int = 0
    decode_row_s: float = 0.0
    max_running: int = 256
    partial: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SimCost:
        known = set(asdict(cls()))
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown simulation cost field(s): {sorted(unknown)}")
        return cls(**values)
