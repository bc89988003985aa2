"""Hand-computed checks of flowrl.algorithms: every expected number below is worked out by hand
(intermediate steps in the comments), never by calling the function under test twice."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import Tensor

import flowrl.algorithms as alg
from flowrl.algorithms import (
    LossAgg,
    aggregate_loss,
    compute_policy_loss,
    default_tis_cap,
    discounted_returns,
    dr_grpo_advantages,
    expand_to_tokens,
    filter_groups,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    kl_loss,
    masked_mean,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    sampled_entropy,
    tis_weights,
    token_level_rewards,
    value_loss,
)

pytestmark = pytest.mark.timeout(30)

TOL = 1e-6
F64 = torch.float64


def t(values: object, dtype: torch.dtype = F64) -> Tensor:
    return torch.tensor(values, dtype=dtype)


def close(actual: Tensor | float, expected: object) -> None:
    a = actual if isinstance(actual, Tensor) else torch.tensor(actual, dtype=F64)
    torch.testing.assert_close(a, t(expected, a.dtype), atol=TOL, rtol=0)


# Groups: id 7 = [1, 2, 3], id 3 = [0, 4], id 9 = [5] (a group of one), interleaved on purpose.
REWARDS = t([1.0, 0.0, 2.0, 4.0, 5.0, 3.0])
GROUPS = t([7, 3, 7, 3, 9, 7], torch.long)


# ----------------------------------------------------------------------------- group advantages


def test_grpo_unbiased_std_variable_groups() -> None:
    # id 7: mean 2, var (1+0+1)/(3-1) = 1, std 1 -> (-1, 0, 1)
    # id 3: mean 2, var (4+4)/(2-1) = 8, std 2*sqrt(2) -> -/+ 2/(2*sqrt 2) = -/+ 0.70710678
    # id 9: a group of one -> 0
    adv = grpo_advantages(REWARDS, GROUPS, eps=0.0)
    close(adv, [-1.0, -0.70710678, 0.0, 0.70710678, 0.0, 1.0])


def test_grpo_eps_is_added_to_std() -> None:
    # id 7: 1/(1 + 0.5) = 0.6666667; id 3: 2/(2.8284271 + 0.5) = 0.6008844
    # (sqrt(var + eps) would give 1/sqrt(1.5) = 0.8164966 instead)
    adv = grpo_advantages(REWARDS, GROUPS, eps=0.5)
    close(adv, [-0.6666667, -0.6008844, 0.0, 0.6008844, 0.0, 0.6666667])


def test_grpo_accepts_group_matrix() -> None:
    # rows are groups: [1, 0, 0, 1]: mean .5, var 4*.25/3 = 1/3, std .5773503 -> +/- .8660254
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0]]), eps=0.0)
    close(adv, [[0.8660254, -0.8660254, -0.8660254, 0.8660254], [0.0, 0.0, 0.0, 0.0]])


def test_all_equal_rewards_give_exact_zero_even_without_eps() -> None:
    # 0.1 + 0.1 + 0.1 is not 0.3 in floating point: the mean is off by one ulp, and a naive
    # (r - mean) / std would be +/-1-sized noise. Constant groups are defined to give 0.
    for rewards in ([0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0]):
        r = t(rewards)
        ids = torch.zeros(len(rewards), dtype=torch.long)
        for adv in (
            grpo_advantages(r, ids, eps=0.0),
            dr_grpo_advantages(r, ids),
            rloo_advantages(r, ids),
        ):
            assert torch.equal(adv, torch.zeros_like(r))


def test_dr_grpo_no_std() -> None:
    # id 7 mean 2: (-1, 0, 1); id 3 mean 2: (-2, 2); id 9: 0
    close(dr_grpo_advantages(REWARDS, GROUPS), [-1.0, -2.0, 0.0, 2.0, 0.0, 1.0])


def test_rloo_leave_one_out() -> None:
    # id 7 [1,2,3]: 1-(2+3)/2 = -1.5, 2-(1+3)/2 = 0, 3-(1+2)/2 = 1.5
    # id 3 [0,4]: 0-4 = -4, 4-0 = 4; id 9 (no other sample): 0
    close(rloo_advantages(REWARDS, GROUPS), [-1.5, -4.0, 0.0, 4.0, 0.0, 1.5])


def test_group_advantages_keep_float32_and_shape() -> None:
    r = t([1.0, 0.0], torch.float32)
    ids = t([0, 0], torch.long)
    out = grpo_advantages(r, ids, eps=0.0)
    assert out.dtype == torch.float32
    close(out, [0.70710678, -0.70710678])  # mean .5, std sqrt(.5) -> .5/.7071068
    # integer rewards are promoted to float32
    assert rloo_advantages(t([1, 0], torch.long), ids).dtype == torch.float32


def test_group_input_validation() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(REWARDS, GROUPS.double())
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        rloo_advantages(REWARDS)


# ------------------------------------------------------------------------------- dynamic sampling


def test_filter_groups_drops_zero_variance_and_singletons() -> None:
    rewards = t([1.0, 1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 2.0, 0.0, 0.5])
    ids = t([10, 10, 10, 11, 11, 12, 13, 13, 14, 14], torch.long)
    res = filter_groups(rewards, ids)
    assert res.keep_rows.tolist() == [False] * 3 + [True] * 2 + [False] * 3 + [True] * 2
    assert res.kept_groups.tolist() == [11, 14]
    assert res.dropped_groups.tolist() == [10, 12, 13]
    # spread of 11 is 1.0, of 14 is 0.5: a threshold of 0.6 keeps only 11
    res = filter_groups(rewards, ids, min_spread=0.6)
    assert res.kept_groups.tolist() == [11]
    assert res.keep_rows.tolist() == [False] * 3 + [True] * 2 + [False] * 5


# ------------------------------------------------------------------------------------ KL


LP = t([[-1.0, -2.0, float("nan")]])
REF = t([[-1.5, -1.0, -3.0]])
KL_MASK = t([[1, 1, 0]], torch.bool)


def test_kl_estimators() -> None:
    # log r = ref - lp = (-0.5, 1.0)
    close(kl_estimate(LP, REF, KL_MASK, "k1"), [[0.5, -1.0, 0.0]])  # -log r
    close(kl_estimate(LP, REF, KL_MASK, "k2"), [[0.125, 0.5, 0.0]])  # (log r)^2 / 2
    # (r - 1) - log r: e^-0.5 - 1 + 0.5 = 0.1065307, e - 1 - 1 = 0.7182818
    close(kl_estimate(LP, REF, KL_MASK, "k3"), [[0.10653066, 0.71828183, 0.0]])
    with pytest.raises(ValueError, match="estimator"):
        kl_estimate(LP, REF, KL_MASK, "k4")  # type: ignore[arg-type]


def test_kl_loss_term_and_gradient() -> None:
    lp = LP.clone().requires_grad_(True)
    # k3 token-mean: (0.1065307 + 0.7182818)/2 = 0.4124062; x 0.04 = 0.01649625
    loss = kl_loss(lp, REF, KL_MASK, coef=0.04)
    close(loss.detach(), 0.01649625)
    loss.backward()  # type: ignore[no-untyped-call]
    # d k3 / d lp = 1 - exp(ref - lp): 1 - e^-0.5 = 0.3934693, 1 - e = -1.7182818; x 0.04 / 2
    assert lp.grad is not None
    close(lp.grad, [[0.00786939, -0.03436564, 0.0]])


# ------------------------------------------------------------------------- token-level helpers


TOK_MASK = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]], torch.bool)


def test_expand_and_token_level_rewards() -> None:
    close(expand_to_tokens(t([2.0, -1.0, 7.0]), TOK_MASK), [[2, 2, 0], [-1, -1, -1], [0, 0, 0]])
    # reward on the last valid token; the empty row gets nothing
    kl = t([[0.5, -1.0, 99.0], [0.0, 0.5, -0.25], [3.0, 3.0, 3.0]])
    out = token_level_rewards(t([1.0, 0.0, 4.0]), TOK_MASK, kl=kl, kl_coef=0.1)
    close(out, [[-0.05, 1.1, 0.0], [0.0, -0.05, 0.025], [0.0, 0.0, 0.0]])
    # a hole in the mask: the last valid token is index 2
    close(token_level_rewards(t([1.0]), t([[1, 0, 1, 0]])), [[0.0, 0.0, 1.0, 0.0]])


def test_discounted_returns() -> None:
    r = t([[-0.05, 1.1, 50.0], [0.0, -0.05, 0.025]])
    mask = TOK_MASK[:2]
    # gamma 1: reverse sums. row 0: (1.05, 1.1); row 1: (-0.025, -0.025, 0.025)
    close(discounted_returns(r, mask), [[1.05, 1.1, 0.0], [-0.025, -0.025, 0.025]])
    # gamma .5: row 0: 1.1, -0.05 + .55 = .5; row 1: .025, -.05 + .0125 = -.0375, -.01875
    close(
        discounted_returns(r, mask, gamma=0.5),
        [[0.5, 1.1, 0.0], [-0.01875, -0.0375, 0.025]],
    )
    # a masked hole is skipped, not a step: 1 + .5*(2) = 2 at t0, 2 at t2
    close(discounted_returns(t([[1.0, 9.0, 2.0]]), t([[1, 0, 1]]), gamma=0.5), [[2.0, 0.0, 2.0]])


def test_masked_whiten_population_variance() -> None:
    # valid (1, 2, 3, 6): mean 3, population var (4+1+0+9)/4 = 3.5, std 1.8708287
    out = masked_whiten(t([[1.0, 2.0, 100.0], [3.0, 6.0, -100.0]]), t([[1, 1, 0], [1, 1, 0]]))
    close(out, [[-1.0690450, -0.5345225, 0.0], [0.0, 1.6035675, 0.0]])
    # no valid token: zeros, not nan
    close(masked_whiten(t([[5.0]]), t([[0]])), [[0.0]])


# ---------------------------------------------------------------------------------- REINFORCE++


RPP_LP = t([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
RPP_REF = t([[-1.5, -1.0, 0.0], [-0.5, -1.0, -0.25]])
RPP_MASK = t([[1, 1, 0], [1, 1, 1]], torch.bool)


def test_reinforce_pp_global_whitening_with_kl_penalty() -> None:
    # k1 = old - ref: row0 (0.5, -1.0), row1 (0, 0.5, -0.25); coef 0.1, rewards (1, 0)
    # token rewards: row0 (-0.05, 1.1), row1 (0, -0.05, 0.025)
    # returns (gamma 1): row0 (1.05, 1.1), row1 (-0.025, -0.025, 0.025)
    # mean 2.125/5 = 0.425; deviations (.625, .675, -.45, -.45, -.4)
    # population var (.390625 + .455625 + .2025 + .2025 + .16)/5 = .28225, std .53127206
    adv = reinforce_pp_advantages(
        t([1.0, 0.0]), RPP_MASK, old_logprobs=RPP_LP, ref_logprobs=RPP_REF, kl_coef=0.1
    )
    close(adv, [[1.17642174, 1.27053548, 0.0], [-0.84702365, -0.84702365, -0.75290991]])


def test_reinforce_pp_discounted() -> None:
    # same token rewards, gamma .5 returns: row0 (.5, 1.1), row1 (-.01875, -.0375, .025)
    # mean 1.56875/5 = .31375; deviations (.18625, .78625, -.3325, -.35125, -.28875)
    # squares sum .9701875, population var .1940375, std .44049687
    adv = reinforce_pp_advantages(
        t([1.0, 0.0]),
        RPP_MASK,
        old_logprobs=RPP_LP,
        ref_logprobs=RPP_REF,
        kl_coef=0.1,
        gamma=0.5,
    )
    close(adv, [[0.42281798, 1.78491617, 0.0], [-0.75482941, -0.79739498, -0.65550975]])


def test_reinforce_pp_baseline_subtracts_group_mean() -> None:
    # group (1, 0) -> centered (.5, -.5) on the last tokens; no KL
    # returns row0 (.5, .5), row1 (-.5, -.5, -.5): mean -.1, devs (.6, .6, -.4, -.4, -.4)
    # population var (3*.36 ... ) = (.36*2 + .16*3)/5 = .24, std .48989795
    adv = reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, group_ids=t([4, 4], torch.long))
    close(adv, [[1.22474487, 1.22474487, 0.0], [-0.81649658, -0.81649658, -0.81649658]])
    with pytest.raises(ValueError, match="kl_coef"):
        reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, kl_coef=0.1)


# ------------------------------------------------------------------------------------ GAE


def test_gae_hand_computed() -> None:
    gamma, lam = 0.9, 0.8  # gamma*lam = 0.72
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0], [0.0, 3.0, 1.0]])
    values = t([[0.5, 0.6, 0.7], [0.2, 0.4, 100.0], [0.5, 9.0, 0.7]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]], torch.bool)
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    # row0: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03, A1 = .03 + .72*.3 = .246;
    #       d0 = .9*.6 - .5 = .04, A0 = .04 + .72*.246 = .21712
    # row1 (last token masked): d1 = 1 - .4 = .6; d0 = .9*.4 - .2 = .16, A0 = .16 + .72*.6 = .592
    # row2 (hole at t1, skipped): A2 = .3; d0 = .9*.7 - .5 = .13, A0 = .13 + .72*.3 = .346
    close(adv, [[0.21712, 0.246, 0.3], [0.592, 0.6, 0.0], [0.346, 0.0, 0.3]])
    # returns = A + V
    close(ret, [[0.71712, 0.846, 1.0], [0.792, 1.0, 0.0], [0.846, 0.0, 1.0]])


def test_gae_whitened() -> None:
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = t([[0.5, 0.6, 0.7], [0.2, 0.4, 100.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # raw (.21712, .246, .3, .592, .6): mean .391024,
    # deviations (-.173904, -.145024, -.091024, .200976, .208976), population var .0287244503
    close(adv, [[-1.02608587, -0.85568519, -0.53706896], [1.18581881, 1.23302121, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [0.792, 1.0, 0.0]])  # returns are not whitened


# ------------------------------------------------------------------------------- value loss


def test_value_loss_clipped_and_unclipped() -> None:
    values = t([[1.0, 2.0, 1.5, 50.0]]).requires_grad_(True)
    old = t([[0.9, 1.5, 0.5, 0.0]])
    returns = t([[1.2, 1.0, 2.0, 0.0]])
    mask = t([[1, 1, 1, 0]])
    # tok0: in range, (1-1.2)^2 = .04
    # tok1: clipped V 1.7: max((2-1)^2, (1.7-1)^2) = max(1, .49) = 1
    # tok2: clipped V .7:  max((1.5-2)^2, (.7-2)^2) = max(.25, 1.69) = 1.69 (clipped active)
    # loss = .5 * (.04 + 1 + 1.69)/3 = .455
    loss, metrics = value_loss(values, old, returns, mask, clip_eps=0.2)
    close(loss.detach(), 0.455)
    assert metrics["vf_clip_frac"] == pytest.approx(1 / 3, abs=TOL)
    assert metrics["vf_loss"] == pytest.approx(0.455, abs=TOL)
    loss.backward()  # type: ignore[no-untyped-call]
    # d/dV: tok0 (V-R)/3 = -.2/3; tok1 (V-R)/3 = 1/3; tok2 clipped term has no grad wrt V
    assert values.grad is not None
    close(values.grad, [[-0.0666667, 0.3333333, 0.0, 0.0]])
    # without clipping: .5 * (.04 + 1 + .25)/3 = .215
    loss, metrics = value_loss(values, old, returns, mask, clip_eps=None)
    close(loss.detach(), 0.215)
    assert metrics["vf_clip_frac"] == 0.0


# ------------------------------------------------------------------------ loss aggregation


def test_aggregation_modes() -> None:
    loss_mat = t([[-1.1, -1.28, -0.7, 9.0], [1.8, 1.6, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    # token-mean: (-3.08 + 3.4)/5 = .064
    close(aggregate_loss(loss_mat, mask, "token-mean"), 0.064)
    close(aggregate_loss(loss_mat, mask, "token-mean", num_tokens=10), 0.032)
    # seq-mean-token-mean: (-3.08/3 + 3.4/2)/2 = (-1.0266667 + 1.7)/2; the empty row not counted
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-mean"), 0.33666667)
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-mean", num_seqs=4), 0.16833333)
    # seq-mean-token-sum-norm, default divisor T = 4: (-3.08/4 + 3.4/4)/2 = (-.77 + .85)/2 = .04
    # with max_tokens 8: (-.385 + .425)/2 = .02
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm"), 0.04)
    close(aggregate_loss(loss_mat, mask, "seq-mean-token-sum-norm", max_tokens=8), 0.02)
    close(masked_mean(loss_mat, mask), 0.064)
    # an all-masked batch is 0, not nan
    close(aggregate_loss(loss_mat, torch.zeros_like(mask), "seq-mean-token-mean"), 0.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss_mat, mask, "mean")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ policy loss

# Row 0: advantage +1, ratios (1.1, 1.3, 0.7); row 1: advantage -2, ratios (0.9, 0.7), 1 pad.
RATIOS = [[1.1, 1.3, 0.7], [0.9, 0.7, 1.0]]
OLD = t([[-1.0, -2.0, -0.5], [-0.3, -1.2, float("-inf")]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = t([1.0, -2.0])


def logprobs_for(ratios: list[list[float]]) -> Tensor:
    lp = OLD.clone()
    for i, row in enumerate(ratios):
        for j, r in enumerate(row):
            if MASK[i, j]:
                lp[i, j] += math.log(r)
    lp[1, 2] = float("nan")  # padding garbage: must not reach loss or gradient
    return lp.requires_grad_(True)


def test_ppo_clip_higher_token_mean() -> None:
    lp = logprobs_for(RATIOS)
    loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.28)
    # row0 (A=1):  1.1 -> -1.1; 1.3 -> clip 1.28 -> max(-1.3, -1.28) = -1.28 (clipped);
    #              0.7 -> clip 0.8 -> max(-0.7, -0.8) = -0.7 (not clipped)
    # row1 (A=-2): 0.9 -> 1.8; 0.7 -> clip 0.8 -> max(1.4, 1.6) = 1.6 (clipped)
    # token-mean (-1.1 - 1.28 - 0.7 + 1.8 + 1.6)/5 = 0.32/5 = .064
    close(loss.detach(), 0.064)
    assert set(metrics) == {"pg_loss", "clip_frac", "approx_kl"}
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["clip_frac"] == pytest.approx(0.4, abs=TOL)
    # k3(rho) = rho - 1 - ln rho: .0046898 + .0376357 + .0566749 + .0053605 + .0566749 = .1610359
    assert metrics["approx_kl"] == pytest.approx(0.03220719, abs=TOL)
    loss.backward()  # type: ignore[no-untyped-call]
    # d/dlp of -A*rho/5 = -A*rho/5 where not clipped, 0 where clipped or masked
    assert lp.grad is not None
    close(lp.grad, [[-0.22, 0.0, -0.14], [0.36, 0.0, 0.0]])


def test_ppo_symmetric_clip_by_default() -> None:
    lp = logprobs_for(RATIOS)
    loss, _ = compute_policy_loss(lp, OLD, ADV, MASK)
    # 1.3 now clips at 1.2: (-1.1 - 1.2 - 0.7 + 1.8 + 1.6)/5 = .08
    close(loss.detach(), 0.08)


def test_policy_loss_aggregation_modes() -> None:
    lp = logprobs_for(RATIOS)
    # token losses as in the clip-higher test: row0 sum -3.08 (3 tokens), row1 sum 3.4 (2 tokens)
    loss, _ = compute_policy_loss(
        lp, OLD, ADV, MASK, loss_agg="seq-mean-token-mean", clip_eps_high=0.28
    )
    close(loss.detach(), 0.33666667)  # (-3.08/3 + 3.4/2)/2
    loss, _ = compute_policy_loss(
        lp, OLD, ADV, MASK, loss_agg="seq-mean-token-sum-norm", max_tokens=4, clip_eps_high=0.28
    )
    close(loss.detach(), 0.04)  # (-3.08/4 + 3.4/4)/2
    loss, _ = compute_policy_loss(lp, OLD, ADV, MASK, num_tokens=10, clip_eps_high=0.28)
    close(loss.detach(), 0.032)  # .32/10


def test_per_token_advantages() -> None:
    lp = logprobs_for([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = t([[1.0, 2.0, 3.0], [-1.0, 0.5, float("nan")]])
    loss, metrics = compute_policy_loss(lp, OLD, adv, MASK)
    # ratio 1 everywhere: -(1 + 2 + 3 - 1 + .5)/5 = -1.1
    close(loss.detach(), -1.1)
    assert metrics["clip_frac"] == 0.0
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=TOL)


def test_tis_weights_and_loss() -> None:
    lp = logprobs_for(RATIOS)
    # raw weights exp(old - rollout): row0 (1, 3, .5) -> capped (1, 2, .5); row1 (1.5, .25)
    raw = [[1.0, 3.0, 0.5], [1.5, 0.25, 1.0]]
    rollout = OLD - t([[math.log(w) for w in row] for row in raw])
    rollout[1, 2] = float("inf")
    close(tis_weights(OLD, rollout, MASK, cap=2.0), [[1.0, 2.0, 0.5], [1.5, 0.25, 0.0]])
    # old logprobs and advantages that carry a graph must still be treated as constants
    old = OLD.clone().requires_grad_(True)
    adv = ADV.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp, old, adv, MASK, clip_eps_high=0.28, rollout_logprobs=rollout, tis_cap=2.0
    )
    # weighted token losses: -1.1, -2.56, -.35, 2.7, .4 -> sum -.91, /5 = -.182
    close(loss.detach(), -0.182)
    assert metrics["tis_mean"] == pytest.approx(1.05, abs=TOL)  # (1+2+.5+1.5+.25)/5
    loss.backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None
    # unweighted grads (-.22, 0, -.14, .36, 0) times the weights
    close(lp.grad, [[-0.22, 0.0, -0.07], [0.54, 0.0, 0.0]])
    assert old.grad is None
    assert adv.grad is None
    # no TIS unless a cap is given; a cap needs the rollout logprobs
    _, metrics = compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout)
    assert "tis_mean" not in metrics
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(lp, OLD, ADV, MASK, tis_cap=2.0)


def test_default_tis_cap() -> None:
    assert default_tis_cap(0) is None
    assert default_tis_cap(1) == 2.0
    assert default_tis_cap(3) == alg.DEFAULT_TIS_CAP
    with pytest.raises(ValueError, match="max_staleness"):
        default_tis_cap(-1)


def test_kl_and_entropy_terms() -> None:
    lp = logprobs_for(RATIOS)
    ref = (lp - t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])).detach()  # k1 = lp - ref
    entropy = t([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    loss, metrics = compute_policy_loss(
        lp,
        OLD,
        ADV,
        MASK,
        clip_eps_high=0.28,
        ref_logprobs=ref,
        kl_coef=0.1,
        kl_estimator="k1",
        entropy=entropy,
        entropy_coef=0.02,
    )
    # pg .064; kl token-mean (.1+.2+.3+.4+.5)/5 = .3, x .1 = .03;
    # entropy token-mean 15/5 = 3, x .02 = .06 -> .064 + .03 - .06 = .034
    close(loss.detach(), 0.034)
    assert metrics["pg_loss"] == pytest.approx(0.064, abs=TOL)
    assert metrics["kl_loss"] == pytest.approx(0.3, abs=TOL)
    assert metrics["entropy"] == pytest.approx(3.0, abs=TOL)
    loss.backward()  # type: ignore[no-untyped-call]
    # pg grads plus d(.1 * k1 / 5)/dlp = .02 on every valid token
    assert lp.grad is not None
    close(lp.grad, [[-0.2, 0.02, -0.12], [0.38, 0.02, 0.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(lp, OLD, ADV, MASK, kl_coef=0.1)


def test_sampled_entropy_is_the_surprisal_with_the_entropy_gradient() -> None:
    # Sampled tokens with probabilities 1/2, 1/4 (row 0), 1/8 and a masked 99 (row 1).
    lp = t([[math.log(0.5), math.log(0.25)], [math.log(0.125), 99.0]]).requires_grad_(True)
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    ent = sampled_entropy(lp, mask)
    # value: -log p = ln 2, 2 ln 2, 3 ln 2; 0 where masked
    ln2 = math.log(2.0)
    close(ent.detach(), [[ln2, 2 * ln2], [3 * ln2, 0.0]])
    ent.sum().backward()  # type: ignore[no-untyped-call]
    # d/dlp of (-sg(lp))·(1 + lp - sg(lp)) = -sg(lp): the score-function weight of each token
    assert lp.grad is not None
    close(lp.grad, [[ln2, 2 * ln2], [3 * ln2, 0.0]])


def test_sampled_entropy_gradient_is_the_entropy_gradient_in_expectation() -> None:
    # One softmax over 3 actions, logits z: summed over every action weighted by its
    # probability, the estimator's gradient is dH/dz exactly.
    z = torch.tensor([0.3, -1.2, 0.8], dtype=F64, requires_grad=True)
    logp = torch.log_softmax(z, -1)
    p = logp.exp().detach()
    surrogate = (p * sampled_entropy(logp[None, :], torch.ones(1, 3))[0]).sum()
    (grad,) = torch.autograd.grad(surrogate, z)
    h = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum()
    (want,) = torch.autograd.grad(h, z)
    close(grad, want.tolist())
    # and its value is the entropy
    close(surrogate.detach(), float(h.detach()))


def test_gradients_only_at_valid_tokens() -> None:
    torch.manual_seed(0)
    b, n = 4, 6
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2] = False  # a row with no valid token
    old = -torch.rand(b, n, dtype=F64) - 0.1
    old[~mask] = float("-inf")
    # small perturbations: no token is clipped, so every valid token must get a gradient
    lp = (old.masked_fill(~mask, 0.0) + 0.01 * torch.randn(b, n, dtype=F64)).masked_fill(
        ~mask, float("nan")
    )
    lp.requires_grad_(True)
    adv = t([1.0, -0.5, 2.0, 0.7])
    modes: tuple[LossAgg, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    for mode in modes:
        lp.grad = None
        loss, metrics = compute_policy_loss(
            lp,
            old,
            adv,
            mask,
            loss_agg=mode,
            ref_logprobs=old,
            kl_coef=0.01,
            rollout_logprobs=old,
            tis_cap=2.0,
        )
        assert torch.isfinite(loss)
        assert all(math.isfinite(v) for v in metrics.values())
        loss.backward()  # type: ignore[no-untyped-call]
        assert lp.grad is not None
        assert torch.isfinite(lp.grad).all()
        assert (lp.grad[mask] != 0).all()
        assert (lp.grad[~mask] == 0).all()


def test_policy_loss_shape_validation() -> None:
    lp = logprobs_for(RATIOS)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(lp, OLD, t([1.0, 2.0, 3.0]), MASK)
    with pytest.raises(ValueError, match="mask"):
        compute_policy_loss(lp, OLD, ADV, MASK[:, :2])
    with pytest.raises(ValueError, match="clip_eps"):
        compute_policy_loss(lp, OLD, ADV, MASK, clip_eps_low=1.5)


# -------------------------------------------------------------------------------- public API


def test_public_api_is_pinned() -> None:
    assert sorted(alg.__all__) == sorted(
        [
            "CLIP_DEFAULTS",
            "DEFAULT_MASK_BOUNDS",
            "DEFAULT_TIS_CAP",
            "CorrectionKind",
            "GroupFilter",
            "KLEstimator",
            "LossAgg",
            "MASKING_KINDS",
            "PolicyLoss",
            "RolloutCorrection",
            "aggregate_loss",
            "clip_range",
            "compute_policy_loss",
            "correction_weights",
            "default_tis_cap",
            "discounted_returns",
            "dr_grpo_advantages",
            "expand_to_tokens",
            "filter_groups",
            "gae_advantages",
            "grpo_advantages",
            "kl_estimate",
            "kl_loss",
            "masked_mean",
            "masked_whiten",
            "reinforce_pp_advantages",
            "rloo_advantages",
            "sampled_entropy",
            "tis_weights",
            "token_level_rewards",
            "value_loss",
        ]
    )
    params = list(inspect.signature(compute_policy_loss).parameters)
    assert params == [
        "logprobs",
        "old_logprobs",
        "advantages",
        "mask",
        "policy_loss",
        "clip_eps_low",
        "clip_eps_high",
        "loss_agg",
        "max_tokens",
        "num_tokens",
        "num_seqs",
        "rollout_logprobs",
        "tis_cap",
        "correction",
        "ref_logprobs",
        "kl_coef",
        "kl_estimator",
        "entropy",
        "entropy_coef",
    ]


def test_half_precision_logprobs_are_upcast() -> None:
    # bf16 cannot represent 1.1 - 1 accurately: ratios are formed in fp32, the loss is fp32
    lp = logprobs_for(RATIOS).detach().to(torch.bfloat16).requires_grad_(True)
    loss, _ = compute_policy_loss(lp, OLD.to(torch.bfloat16), ADV.float(), MASK)
    assert loss.dtype == torch.float32
    loss.backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None
    assert lp.grad.dtype == torch.bfloat16
    assert torch.isfinite(loss)
