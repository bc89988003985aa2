"""The ``stability`` section: the guard that watches each step's training signals and acts
when one says the run is going wrong (`flowrl.control.stability` describes each signal and
action). On by default, with thresholds that a healthy run does not reach."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowrl.recipe.section import _Section

GuardActionName = Literal["warn", "tighten_staleness", "lower_lr", "rollback"]


class StabilityActions(_Section):
    """The action each signal takes once past its threshold."""

    mismatch_kl: GuardActionName = "tighten_staleness"
    entropy: GuardActionName = "warn"
    flat_groups: GuardActionName = "warn"
    clip_frac: GuardActionName = "lower_lr"
    reward_drop: GuardActionName = "rollback"


class StabilityConfig(_Section):
    """Thresholds of the stability guard; a threshold of None turns its signal off."""

    enabled: bool = True
    """Watch the signals and act on them; False only records them in the step log."""
    warmup_steps: int = Field(default=20, ge=0, le=10**6)
    """Steps not judged at the start (the signals settle first); the entropy's reference is
    its mean over them."""
    window: int = Field(default=5, ge=1, le=1000)
    """Consecutive steps a signal must stay past its threshold before the guard acts."""
    cooldown_steps: int = Field(default=20, ge=0, le=10**6)
    """Steps after an action before the same signal may act again."""
    reward_window: int = Field(default=10, ge=1, le=1000)
    """Steps whose mean reward is compared with its best (``reward_drop``)."""
    mismatch_kl_max: float | None = Field(default=0.5, gt=0.0)
    """KL between the sampling policy and the trainer's, per token (``train_mismatch_kl``)."""
    entropy_min_ratio: float | None = Field(default=0.05, gt=0.0, lt=1.0)
    """The entropy may not fall below this share of its mean over the warm-up steps."""
    flat_groups_max: float | None = Field(default=0.95, gt=0.0, le=1.0)
    """Share of groups whose responses all scored alike, while the reward is below its best."""
    clip_frac_max: float | None = Field(default=0.5, gt=0.0, le=1.0)
    """Share of tokens whose ratio was clipped."""
    reward_drop: float | None = Field(default=0.5, gt=0.0, le=1.0)
    """Share of the run's reward gain (best moving mean less the first) it may lose."""
    reward_min_gain: float = Field(default=0.2, ge=0.0)
    """A reward drop is judged against the run's gain once it has gained this much; until
    then, a fall of this much below its first moving mean is a drop."""
    actions: StabilityActions = Field(default_factory=StabilityActions)
    """What each signal does: warn, tighten_staleness, lower_lr or rollback."""
    lr_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """``lower_lr`` and ``rollback`` multiply the learning rate by this."""
    keep_every: int = Field(default=10, ge=1, le=10**6)
    """Versions between the trainer's in-memory copies of good weights (rollback targets)."""
