"""The cost model of simulated workers (`workers.sim`, `workers.sim_episode`): a recipe's
``sim`` section as the workers read it from their spec."""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any

from flowrl.run_trace import read_trace
from flowrl.trace_costs import TraceCosts


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
    #: a recorded run's trace to draw times and lengths from (None: the model above)
    trace: str | None = None
    #: multiplies every time drawn from the trace (CPU contention the recorded run did not have)
    trace_stretch: float | dict[str, float] = 1.0

    def replay(self) -> TraceCosts | None:
        """The trace's costs, read once per process; None without a trace."""
        if self.trace is None:
            return None
        stretch = self.trace_stretch
        return _trace_costs(self.trace, tuple(sorted(stretch.items()))
                            if isinstance(stretch, dict) else stretch)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SimCost:
        known = set(asdict(cls()))
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown simulation cost field(s): {sorted(unknown)}")
        return cls(**values)


@functools.cache
def _trace_costs(path: str, stretch: float | tuple[tuple[str, float], ...]) -> TraceCosts:
    return TraceCosts(read_trace(path),
                      stretch=dict(stretch) if isinstance(stretch, tuple) else stretch)
