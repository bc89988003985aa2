"""The stability guard on recorded metric streams: what it does, when, and what train tasks
then carry (pure: `flowrl.control.stability`)."""

from __future__ import annotations

from typing import Any

import pytest

from flowrl.control.stability import StabilityGuard
from flowrl.recipe import StabilityConfig
from flowrl.recipe_file import RecipeError, load_recipe


def healthy(step: int) -> dict[str, Any]:
    """A run that learns: the reward climbs from 0.4 to 0.9 over 50 steps, entropy eases."""
    return {"step": step, "reward_mean": min(0.9, 0.4 + 0.01 * step),
            "train_entropy": 1.0 - 0.005 * min(step, 100), "train_mismatch_kl": 0.01,
            "train_flat_groups": 0.3, "train_clip_frac": 0.0}


def feed(guard: StabilityGuard, lines: list[dict[str, Any]], *, staleness: int = 1,
         kept: bool = True) -> list[tuple[int, str, str]]:
    """Judge each line as the controller does (line ``step`` is version ``step``, made by
    train step ``step - 1``; train step ``step`` is next, none of it handed out yet; the
    trainer reports the weights it keeps); returns (step, signal, action) for every action."""
    out = []
    for line in lines:
        step = line["step"]
        if kept and guard.keep is not None and step > guard.keep:
            line = {**line, "train_kept_version": guard.keep}
        for a in guard.observe(step, step, line, max_staleness=staleness, next_step=step):
            out.append((step, a.signal, a.action))
    return out


def test_a_healthy_run_is_left_alone_and_good_weights_are_kept_on_the_way() -> None:
    guard = StabilityGuard(StabilityConfig())
    assert feed(guard, [healthy(s) for s in range(1, 201)]) == []
    assert guard.lr_scale == 1.0
    assert guard.keep is not None
    assert guard.keep % 10 == 0
    assert guard.kept_version is not None
    orders = guard.train_params(guard.keep)
    assert orders == {"keep_from": guard.keep}
    assert guard.train_params(guard.keep - 1) != orders  # earlier steps keep earlier orders


def test_a_reward_collapse_rolls_back_to_the_kept_weights_and_lowers_the_rate() -> None:
    guard = StabilityGuard(StabilityConfig())
    lines = [healthy(s) for s in range(1, 81)]
    lines += [{**healthy(s), "reward_mean": 0.2} for s in range(81, 101)]
    acted = feed(guard, lines)
    assert acted[0][1:] == ("reward_drop", "rollback")
    # The moving mean (10 steps) crossed the floor 0.9 - 0.5 * gain a few steps in; then
    # ``window`` more steps past it.
    assert 85 <= acted[0][0] <= 95
    step = acted[0][0]
    assert guard.lr_scale == 0.5
    rollback = guard.train_params(step)["rollback"]
    assert rollback == {"id": 1, "version": guard.kept_version}
    assert guard.kept_version is not None
    assert guard.kept_version <= 80
    assert "rollback" not in guard.train_params(step - 1)  # handed out already: unchanged
    assert guard.train_params(step)["lr_scale"] == 0.5
    assert len(acted) == 1  # the drop is judged afresh from the restored policy


def started_high(step: int) -> dict[str, Any]:
    """A run that starts near its best (the default job's warmed-up model): 0.85 to 1.0."""
    return {**healthy(step), "reward_mean": min(1.0, 0.85 + 0.005 * step)}


def test_a_run_that_started_near_its_best_is_still_rolled_back_when_it_collapses() -> None:
    # It can gain 0.15 at most, less than ``reward_min_gain`` (0.2): the drop is judged
    # against where it started instead.
    guard = StabilityGuard(StabilityConfig())
    lines = [started_high(s) for s in range(1, 81)]
    assert feed(guard, lines) == []  # a healthy run is left alone
    lines += [{**started_high(s), "reward_mean": 0.3} for s in range(81, 101)]
    acted = feed(StabilityGuard(StabilityConfig()), lines)
    assert acted[0][1:] == ("reward_drop", "rollback")
    assert 85 <= acted[0][0] <= 95


def test_a_dip_within_the_minimum_gain_of_the_start_is_left_alone() -> None:
    lines = [started_high(s) for s in range(1, 61)]
    # its first moving mean (after the warm-up) is ~0.93: 0.8 is within 0.2 of it
    lines += [{**started_high(s), "reward_mean": 0.8} for s in range(61, 101)]
    assert feed(StabilityGuard(StabilityConfig()), lines) == []


def test_a_collapse_with_nothing_kept_only_lowers_the_rate() -> None:
    guard = StabilityGuard(StabilityConfig())
    lines = [healthy(s) for s in range(1, 81)]
    lines += [{**healthy(s), "reward_mean": 0.2} for s in range(81, 101)]
    acted = feed(guard, lines, kept=False)
    assert acted[0][1:] == ("reward_drop", "rollback")
    assert guard.lr_scale == 0.5
    assert "rollback" not in guard.train_params(200)


def test_a_mismatch_tightens_staleness_after_its_window_and_then_cools_down() -> None:
    guard = StabilityGuard(StabilityConfig(window=3, cooldown_steps=10))
    lines = [healthy(s) for s in range(1, 21)]
    lines += [{**healthy(s), "train_mismatch_kl": 2.0} for s in range(21, 41)]
    acted = feed(guard, lines)
    # 3 steps past the threshold, then not again for 10 steps.
    assert acted == [(23, "mismatch_kl", "tighten_staleness"),
                     (33, "mismatch_kl", "tighten_staleness")]
    # Already synchronous: it can only warn.
    guard = StabilityGuard(StabilityConfig(window=3))
    assert feed(guard, lines, staleness=0)[0] == (23, "mismatch_kl", "warn")


def test_entropy_collapse_is_judged_against_its_own_start() -> None:
    guard = StabilityGuard(StabilityConfig())
    lines = [healthy(s) for s in range(1, 41)]
    lines += [{**healthy(s), "train_entropy": 0.01, "reward_mean": 0.45}
              for s in range(41, 61)]
    acted = feed(guard, lines)
    assert acted[0][1:] == ("entropy", "warn")
    # A solved task's policy is deterministic: no warning while the reward holds its best.
    solved = [healthy(s) for s in range(1, 61)]
    solved += [{**healthy(s), "train_entropy": 0.01} for s in range(61, 121)]
    assert feed(StabilityGuard(StabilityConfig()), solved) == []


def test_flat_groups_warn_while_stuck_not_once_solved() -> None:
    stuck = [{**healthy(s), "reward_mean": 0.5, "train_flat_groups": 1.0}
             for s in range(1, 61)]
    assert ("flat_groups", "warn") in [a[1:] for a in feed(StabilityGuard(StabilityConfig()),
                                                            stuck)]
    solved = [{**healthy(s), "train_flat_groups": 1.0 if s > 60 else 0.3}
              for s in range(1, 121)]
    assert feed(StabilityGuard(StabilityConfig()), solved) == []


def near_the_top(step: int, solved: float | None) -> dict[str, Any]:
    """A run that starts close to the reward's maximum (0.85) and solves its task by step 40:
    the reward never rises by ``reward_min_gain``, and at the end every group is flat and
    the policy deterministic. ``solved``: the share of groups that all scored the maximum, as
    the trainer reports it with ``reward.max_score`` known (None: not known)."""
    done = step > 40
    line = {"step": step, "reward_mean": 1.0 if done else 0.85 + 0.003 * step,
            "train_entropy": 0.01 if done else 1.0, "train_mismatch_kl": 0.01,
            "train_flat_groups": 1.0 if done else 0.5, "train_clip_frac": 0.0}
    if solved is not None:
        line["train_solved_groups"] = solved if done else 0.4
    return line


def test_a_run_solved_near_the_top_is_told_from_a_stuck_one_by_its_solved_groups() -> None:
    # Without the maximum, the history cannot tell: a rise of 0.15 is under reward_min_gain.
    lines = [near_the_top(s, None) for s in range(1, 121)]
    assert {a[1] for a in feed(StabilityGuard(StabilityConfig()), lines)} == {
        "entropy", "flat_groups"}
    # With it, every flat group solved: nothing to say.
    lines = [near_the_top(s, 1.0) for s in range(1, 121)]
    assert feed(StabilityGuard(StabilityConfig()), lines) == []
    # The same flat, deterministic policy scoring below the maximum is stuck: both warn.
    lines = [near_the_top(s, 0.0) for s in range(1, 121)]
    assert {a[1:] for a in feed(StabilityGuard(StabilityConfig()), lines)} == {
        ("entropy", "warn"), ("flat_groups", "warn")}
    # Flat groups partly solved: only those below the maximum count against the threshold.
    guard = StabilityGuard(StabilityConfig())
    assert guard._past_threshold("flat_groups", 1.0, 1.0, solved=0.06) is None
    assert guard._past_threshold("flat_groups", 1.0, 1.0, solved=0.01) == (0.99, 0.95)


def test_each_signal_takes_the_action_its_recipe_names_and_none_can_be_turned_off() -> None:
    lines = [healthy(s) for s in range(1, 21)]
    lines += [{**healthy(s), "train_clip_frac": 0.9} for s in range(21, 31)]
    guard = StabilityGuard(StabilityConfig.model_validate(
        {"actions": {"clip_frac": "rollback"}, "lr_factor": 0.25}))
    assert feed(guard, lines) == [(25, "clip_frac", "rollback")]
    assert guard.lr_scale == 0.25
    assert feed(StabilityGuard(StabilityConfig(clip_frac_max=None)), lines) == []
    assert feed(StabilityGuard(StabilityConfig(enabled=False)), lines) == []


def test_nothing_is_judged_in_the_warm_up_and_missing_signals_are_not_judged() -> None:
    lines = [{"step": s, "reward_mean": 0.5, "train_mismatch_kl": 9.0} for s in range(1, 21)]
    assert feed(StabilityGuard(StabilityConfig()), lines) == []
    sim = [{"step": s, "reward_mean": 0.5} for s in range(1, 100)]
    assert feed(StabilityGuard(StabilityConfig()), sim) == []


def test_the_learning_rate_is_never_lowered_below_a_floor() -> None:
    guard = StabilityGuard(StabilityConfig(window=1, cooldown_steps=0, warmup_steps=0))
    feed(guard, [{"step": s, "train_clip_frac": 0.9} for s in range(1, 50)])
    assert guard.lr_scale == pytest.approx(1 / 64)


def test_a_wrong_stability_field_names_the_field_and_the_file(tmp_path: Any) -> None:
    recipe = tmp_path / "r.py"
    recipe.write_text("from flowrl import Recipe\nrecipe = Recipe(steps=1)\n")
    with pytest.raises(RecipeError, match=r"stability\.actions\.entropy.*r\.py|r\.py.*"
                                          r"stability\.actions\.entropy"):
        load_recipe(recipe, ["stability.actions.entropy=explode"])
    assert load_recipe(recipe, ["stability.enabled=false"]).stability.enabled is False
