"""The stability guard: reads each committed step's training signals and decides what to do
when one of them says the run is going wrong.

Signals (each judged only when the step reports it; a threshold of None turns it off):

- ``mismatch_kl``: KL between the policy that generated the samples and the trainer's (the
  engine's numerics, or samples too stale for the learning rate): above ``mismatch_kl_max``;
- ``entropy``: the policy's entropy fell below ``entropy_min_ratio`` of its mean over the
  warm-up steps (it stopped exploring) while the reward is below its best (not solved);
- ``flat_groups``: the share of groups whose responses all scored alike (no learning signal)
  is above ``flat_groups_max`` while the reward is below its best (stuck, not solved);
- ``clip_frac``: the share of clipped tokens is above ``clip_frac_max`` (updates too large);
- ``reward_drop``: the reward's moving mean lost more than ``reward_drop`` of what the run had
  gained over its best (a collapse), once it had gained at least ``reward_min_gain``; before
  that (a run that started near its best has little to gain), a fall of ``reward_min_gain``
  below its first moving mean is one.

Whether the reward is "below its best" is judged from its history: below its best moving mean,
or never risen by ``reward_min_gain``. A run that starts close to the reward's maximum never
rises that much, so once solved it would look stuck. With the maximum known
(``reward.max_score``, so the step reports ``train_solved_groups``: groups that all scored it)
the two signals judge the groups themselves: ``flat_groups`` counts only the flat groups below
the maximum, and the entropy counts while fewer than `SOLVED_SHARE` of the groups are solved.

A signal acts once it has been past its threshold for ``window`` consecutive steps, and not
again for ``cooldown_steps``; nothing is judged during the first ``warmup_steps``. Actions:

- ``warn``: said on the progress line, in the log and as a monitor event;
- ``tighten_staleness``: one version less of rollout lead (at 0 it can only warn);
- ``lower_lr``: the learning rate times ``lr_factor`` from the next step on;
- ``rollback``: the trainer restores the last good weights and optimizer state it kept in
  memory (see below), the learning-rate scale goes back to what it was when they were kept,
  and is then lowered as by ``lower_lr`` (restored weights at the same rate would likely
  fall the same way); with nothing kept yet, only the rate is lowered.

Every ``keep_every`` versions that no signal is past its threshold and the reward is near its
best, the guard asks the trainer to keep its weights as the good ones from the next step on
(``keep_from``); the trainer says which version it holds (the step metric ``kept_version``),
and a rollback goes there. The orders reach trainers as train task params
(`train_params`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from flowrl.recipe.stability import GuardActionName as Action
from flowrl.recipe.stability import StabilityConfig

__all__ = ["SIGNALS", "GuardAction", "StabilityGuard"]

Signal = Literal["mismatch_kl", "entropy", "flat_groups", "clip_frac", "reward_drop"]
SIGNALS: tuple[Signal, ...] = ("mismatch_kl", "entropy", "flat_groups", "clip_frac",
                               "reward_drop")
#: the step-log key each signal is read from
METRIC: dict[Signal, str] = {"mismatch_kl": "train_mismatch_kl", "entropy": "train_entropy",
                             "flat_groups": "train_flat_groups", "clip_frac": "train_clip_frac",
                             "reward_drop": "reward_mean"}
#: the learning rate is never lowered below this share of the recipe's
MIN_LR_SCALE = 1.0 / 64
#: with the reward's maximum known, a low entropy is a solved policy's while at least this
#: share of the step's groups all scored the maximum
SOLVED_SHARE = 0.5


@dataclass(frozen=True)
class GuardAction:
    """What the guard decided at a step: ``signal`` was past ``threshold`` (at ``value``)."""

    step: int
    signal: Signal
    action: Action
    value: float
    threshold: float

    def describe(self) -> str:
        """One line for the progress line and the log."""
        what = {"mismatch_kl": "rollout/trainer KL", "entropy": "entropy",
                "flat_groups": "flat groups", "clip_frac": "clip fraction",
                "reward_drop": "reward"}[self.signal]
        past = {"entropy": "below", "reward_drop": "below"}.get(self.signal, "above")
        return (f"stability: {what} {self.value:.4g} {past} {self.threshold:.4g} for "
                f"the last steps: {self.action.replace('_', ' ')}")


class StabilityGuard:
    def __init__(self, settings: StabilityConfig) -> None:
        self.settings = settings
        self._seen = 0
        self._past: collections.Counter[Signal] = collections.Counter()
        self._acted_at: dict[Signal, int] = {}
        self._entropy_start: list[float] = []
        self._rewards: collections.deque[float] = collections.deque(
            maxlen=settings.reward_window)
        self._first_reward: float | None = None
        self._best_reward: float | None = None
        #: the multiplier of the recipe's learning rate in force
        self.lr_scale = 1.0
        #: the version the trainer last said it keeps as good (None: none yet)
        self.kept_version: int | None = None
        #: the trainer keeps its weights at the start of this step (once per value)
        self.keep: int | None = None
        #: restore orders given (a counter, so that a trainer applies each one once)
        self.rollbacks = 0
        self._orders: list[tuple[int, dict[str, object]]] = []
        #: the rate scale in force at each step the trainer was asked to keep its weights
        self._scale_at: dict[int, float] = {}
        #: every action taken, in order
        self.history: list[GuardAction] = []

    def train_params(self, step: int) -> dict[str, object]:
        """What the train tasks of ``step`` carry from the guard: the orders in force from that
        step on (none while it has done nothing). Orders take effect from a step no task of
        which was handed out yet, so every data-parallel rank meets them at the same step."""
        # A search, not a scan: this runs for every train task, and the list grows by an entry
        # each time the orders change.
        at = bisect.bisect_right(self._orders, step, key=lambda o: o[0])
        return self._orders[at - 1][1] if at else {}

    def scale_lr(self, factor: float, from_step: int) -> None:
        """Multiply the learning rate by ``factor`` from step ``from_step`` on (an order from
        outside the guard: a user's)."""
        if not (factor > 0.0 and math.isfinite(factor)):
            raise ValueError(f"a learning-rate factor must be positive and finite, got {factor}")
        self.lr_scale *= factor
        self._order(from_step)

    def _order(self, from_step: int) -> None:
        orders: dict[str, object] = {}
        if self.lr_scale != 1.0:
            orders["lr_scale"] = self.lr_scale
        if self.keep is not None:
            orders["keep_from"] = self.keep
        if self.rollbacks:
            orders["rollback"] = {"id": self.rollbacks, "version": self.kept_version}
        if not self._orders or self._orders[-1][1] != orders:
            self._orders = [o for o in self._orders if o[0] < from_step] + [(from_step, orders)]

    def observe(self, step: int, version: int, metrics: Mapping[str, object], *,
                max_staleness: int, next_step: int) -> list[GuardAction]:
        """Judge step ``step``'s line (its step-log entry; the policy is now at ``version``);
        returns the actions to take, in order. ``max_staleness``: the lead in force;
        ``next_step``: the first step none of whose train tasks was handed out (the orders
        this makes apply from there)."""
        s = self.settings
        kept = metrics.get("train_kept_version")
        if isinstance(kept, (int, float)):
            self.kept_version = int(kept)
        reward = _number(metrics.get("reward_mean"))
        if reward is not None:
            self._rewards.append(reward)
        if not s.enabled:
            return []
        self._seen += 1
        values = {sig: _number(metrics.get(METRIC[sig])) for sig in SIGNALS}
        if self._seen <= s.warmup_steps:
            if values["entropy"] is not None:
                self._entropy_start.append(values["entropy"])
            return []
        mean_reward = statistics.fmean(self._rewards) if self._rewards else None
        if mean_reward is not None and len(self._rewards) == s.reward_window:
            if self._first_reward is None:
                self._first_reward = mean_reward
            self._best_reward = max(self._best_reward or mean_reward, mean_reward)
        solved = _number(metrics.get("train_solved_groups"))
        actions: list[GuardAction] = []
        for sig in SIGNALS:
            verdict = self._past_threshold(sig, values[sig], mean_reward, solved)
            if verdict is None:
                self._past[sig] = 0
                continue
            value, threshold = verdict
            self._past[sig] += 1
            last = self._acted_at.get(sig)
            if self._past[sig] < s.window or (last is not None
                                              and step - last < s.cooldown_steps):
                continue
            self._acted_at[sig] = step
            self._past[sig] = 0
            action: Action = getattr(s.actions, sig)
            if action == "tighten_staleness" and max_staleness == 0:
                action = "warn"
            actions.append(GuardAction(step, sig, action, value, threshold))
        for a in actions:
            if a.action == "rollback" and self.kept_version is not None:
                self.rollbacks += 1
                # The rate in force when the good weights were kept, lowered: a rate that
                # rose since (a user's, a schedule's) is undone with the weights.
                self.lr_scale = self._scale_at.get(self.kept_version, self.lr_scale)
                self._best_reward = None  # judged afresh from the restored policy
                self._rewards.clear()
            if a.action in ("lower_lr", "rollback"):
                self.lr_scale = max(MIN_LR_SCALE, self.lr_scale * s.lr_factor)
        if (not actions and not any(self._past.values()) and mean_reward is not None
                and self._best_reward is not None and version % s.keep_every == 0
                and mean_reward >= self._best_reward - self._tolerance()):
            self.keep = next_step
            self._scale_at[next_step] = self.lr_scale
        self._order(next_step)
        self.history.extend(actions)
        return actions

    def _tolerance(self) -> float:
        """How far below its best the reward may be for the weights to count as good."""
        s = self.settings
        gain = (self._best_reward or 0.0) - (self._first_reward or 0.0)
        return max(0.0, gain) * (s.reward_drop or 0.5) / 2

    def _past_threshold(self, sig: Signal, value: float | None, mean_reward: float | None,
                        solved: float | None = None) -> tuple[float, float] | None:
        """(value, threshold) when ``sig`` is past its threshold at this step, else None.
        ``solved``: the step's share of groups that all scored the reward's maximum (None: the
        maximum is not known)."""
        s = self.settings
        if sig == "reward_drop":
            if (s.reward_drop is None or mean_reward is None or self._best_reward is None
                    or self._first_reward is None):
                return None
            gain = self._best_reward - self._first_reward
            floor = (self._best_reward - s.reward_drop * gain if gain >= s.reward_min_gain
                     else self._first_reward - s.reward_min_gain)
            return (mean_reward, floor) if mean_reward < floor else None
        if value is None:
            return None
        if sig == "mismatch_kl" and s.mismatch_kl_max is not None:
            return (value, s.mismatch_kl_max) if value > s.mismatch_kl_max else None
        if sig == "clip_frac" and s.clip_frac_max is not None:
            return (value, s.clip_frac_max) if value > s.clip_frac_max else None
        # A policy that solved its task is deterministic and scores alike: both signals count
        # only while the reward is below its best (or has not risen).
        stuck = (mean_reward is None or self._best_reward is None
                 or mean_reward < self._best_reward - self._tolerance()
                 or self._best_reward - (self._first_reward or 0.0) < s.reward_min_gain)
        if solved is not None:  # the groups say it: flat at the maximum is solved
            if sig == "flat_groups" and s.flat_groups_max is not None:
                below = max(0.0, value - solved)
                return (below, s.flat_groups_max) if below > s.flat_groups_max else None
            stuck = stuck and solved < SOLVED_SHARE
        if sig == "entropy" and s.entropy_min_ratio is not None and self._entropy_start:
            floor = s.entropy_min_ratio * statistics.fmean(self._entropy_start)
            return (value, floor) if value < floor and stuck else None
        if sig == "flat_groups" and s.flat_groups_max is not None:
            return (value, s.flat_groups_max) if value > s.flat_groups_max and stuck else None
        return None


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
