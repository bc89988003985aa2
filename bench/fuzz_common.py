"""What every endpoint of the fuzzer (`bench/fuzz.py`) shares: the simulated run it fuzzes,
the pace of its requests, and the figures (messages, valid requests, memory) each reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import psutil

from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages

ENDPOINTS: Final = ("controller", "store", "worker", "monitor", "flood")
FULL_MESSAGES: Final = 100_000
QUICK_MESSAGES: Final = 1_500

# Modelled costs small enough that steps keep coming while the fuzzer runs.
FAST: Final = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.002, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}
GROUP: Final = 4
GROUPS_PER_STEP: Final = 4
# Requests in flight per fuzzing socket: enough to keep the server busy, few enough that its
# replies never reach the high-water mark (a dropped reply would look like a hang here).
WINDOW: Final = 64
VALID_EVERY: Final = 50  # one valid request per this many malformed ones
REPLY_WAIT_S: Final = 10.0


def sim_spec() -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=GROUP, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=2, per_process=2), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=GROUP, groups_per_step=GROUPS_PER_STEP, max_staleness=1,
        engine="sim", engine_config=FAST, store_capacity_bytes=64 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


# ---- memory ---------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    rss: int = psutil.Process(pid).memory_info().rss
    return rss / 2**20


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), or its current one where that is unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss_mb(pid)


@dataclass
class Figures:
    """What one endpoint went through."""

    messages: int = 0
    valid_requests: int = 0
    valid_requests_failed: int = 0
    crashes: int = 0
    peak_rss_mb: float = 0.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("peak_rss_mb", "rss_start_mb", "rss_end_mb", "wall_s"):
            out[key] = round(out[key], 2)
        out["rss_growth_mb"] = round(self.rss_end_mb - self.rss_start_mb, 2)
        return out
