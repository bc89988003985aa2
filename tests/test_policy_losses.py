"""The policy objectives beyond PPO (GSPO, CISPO) and the rollout corrections (sequence-level
TIS, masked IS, IcePop): hand-computed values (worked out in the comments), and GSPO and
token-level TIS against plain loops over the papers' formulas, gradients included."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from flowrl.algorithms import (
    CLIP_DEFAULTS,
    RolloutCorrection,
    clip_range,
    compute_policy_loss,
    correction_weights,
)

pytestmark = pytest.mark.timeout(30)

TOL = 1e-6
F64 = torch.float64
NAN, INF = float("nan"), float("inf")

# Row 0: three valid tokens, advantage +1; row 1: two valid tokens and a pad, advantage -2.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
ADV = torch.tensor([1.0, -2.0], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -INF]], dtype=F64)


def close(actual: Tensor | float, expected: Any) -> None:
    a = actual.detach() if isinstance(actual, Tensor) else torch.tensor(actual, dtype=F64)
    torch.testing.assert_close(a, torch.tensor(expected, dtype=a.dtype), atol=TOL, rtol=0)


def shifted(log_ratios: list[list[float]], base: Tensor = OLD) -> Tensor:
    """Leaf logprobs ``base + log_ratios`` at valid tokens, NaN garbage in the padding."""
    lp = (base + torch.tensor(log_ratios, dtype=F64)).masked_fill(MASK == 0, NAN)
    return lp.requires_grad_(True)


def grad_of(loss: Tensor, lp: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(loss, lp)
    return g


# ------------------------------------------------------------------------------------- GSPO

# Token log-ratios: row 0 (.1, -.2, .4), mean .1, s0 = e^.1 = 1.1051709181;
#                   row 1 (-.3, .1), mean -.1, s1 = e^-.1 = 0.9048374180.
GSPO_LOG_RATIOS = [[0.1, -0.2, 0.4], [-0.3, 0.1, 0.0]]
S0, S1 = math.exp(0.1), math.exp(-0.1)


def test_gspo_unclipped_is_the_mean_of_sequence_losses_with_the_papers_gradient() -> None:
    lp = shifted(GSPO_LOG_RATIOS)
    loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, policy_loss="gspo",
                                        clip_eps_low=0.2, clip_eps_high=0.2)
    # sequence losses -A·s: -1.1051709181 and 2·0.9048374180 = 1.8096748360;
    # default aggregation is the mean over sequences: (−1.1051709181 + 1.8096748360)/2
    close(loss, 0.3522519590)
    assert metrics["clip_frac"] == 0.0
    # ∇ of (1/G)·(−A_i·s_i) with ∂s_i/∂lp_t = s_i/|y_i|: row 0: −1.1051709181/(2·3);
    # row 1: 2·0.9048374180/(2·2); the pad gets nothing
    close(grad_of(loss, lp), [[-0.1841951530] * 3, [0.4524187090] * 2 + [0.0]])
    # token-mean weighs a sequence by its length: (3·−1.1051709181 + 2·1.8096748360)/5
    loss, _ = compute_policy_loss(lp, OLD, ADV, MASK, policy_loss="gspo", clip_eps_low=0.2,
                                  clip_eps_high=0.2, loss_agg="token-mean")
    close(loss, 0.0607673835)


def test_gspo_clips_whole_sequences() -> None:
    lp = shifted(GSPO_LOG_RATIOS)
    loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, policy_loss="gspo",
                                        clip_eps_low=0.05, clip_eps_high=0.2)
    # row 0: s0 = 1.105 < 1.2, unclipped: −1.1051709181
    # row 1 (A = −2): s1 = .9048 < .95: max(−A·s1, −A·.95) = max(1.8096748, 1.9) = 1.9 (clipped)
    close(loss, 0.3974145410)  # (−1.1051709181 + 1.9)/2
    assert metrics["clip_frac"] == pytest.approx(0.4, abs=TOL)  # row 1's two tokens of five
    close(grad_of(loss, lp), [[-0.1841951530] * 3, [0.0] * 3])


def test_gspo_default_clip_range_is_the_papers() -> None:
    assert clip_range("gspo") == CLIP_DEFAULTS["gspo"] == (3e-4, 4e-4)
    lp = shifted(GSPO_LOG_RATIOS)
    loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, policy_loss="gspo")
    # both sequences clip: row 0 at 1.0004 → −1.0004; row 1 at .9997 → 2·.9997 = 1.9994
    close(loss, 0.4995)  # (−1.0004 + 1.9994)/2
    assert metrics["clip_frac"] == 1.0
    close(grad_of(loss, lp), [[0.0] * 3, [0.0] * 3])


def gspo_reference(lp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, low: float,
                   high: float) -> Tensor:
    """GSPO as the paper writes it, one sequence at a time: s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|),
    loss −(1/G)·Σ_i min(s_i·A_i, clip(s_i, 1−low, 1+high)·A_i) over rows with a token."""
    losses = []
    for i in range(lp.shape[0]):
        tokens = [j for j in range(lp.shape[1]) if mask[i, j]]
        if not tokens:
            continue
        log_ratio_sum = sum(lp[i, j] - old[i, j] for j in tokens)
        s = torch.exp(log_ratio_sum / len(tokens))
        a = float(adv[i])
        losses.append(-torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.02, 0.03), (3e-4, 4e-4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_papers_sequence_formula_value_and_gradient(
    clip: tuple[float, float], seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    b, n = 6, 7
    mask = torch.rand(b, n, generator=g) > 0.3
    mask[0, 3:] = False
    mask[4] = False  # a row with no valid token is no sequence
    mask[5] = False
    mask[5, 0] = True  # a one-token sequence
    old = -torch.rand(b, n, generator=g, dtype=F64) * 3
    values = old + 0.05 * torch.randn(b, n, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64)
    lp = values.masked_fill(~mask, NAN).requires_grad_(True)
    ref_lp = values.clone().requires_grad_(True)

    loss, _ = compute_policy_loss(lp, old.masked_fill(~mask, -INF), adv, mask,
                                  policy_loss="gspo", clip_eps_low=clip[0], clip_eps_high=clip[1])
    want = gspo_reference(ref_lp, old, adv, mask, *clip)
    close(loss, float(want.detach()))
    torch.testing.assert_close(grad_of(loss, lp), grad_of(want, ref_lp).masked_fill(~mask, 0.0),
                               atol=1e-9, rtol=1e-7)


def test_gspo_token_takes_per_token_advantages_with_the_papers_gradient() -> None:
    # GSPO-token: the token's loss is −min(s_i,t·A_i,t, clip(s_i,t)·A_i,t) with s_i,t valued
    # s_i, and its gradient is s_i·A_i,t/|y_i|·∇log π(y_t) (/G) where that token is unclipped.
    lp = shifted(GSPO_LOG_RATIOS)
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, -3.0, NAN]], dtype=F64)
    loss, _ = compute_policy_loss(lp, OLD, adv, MASK, policy_loss="gspo",
                                  clip_eps_low=0.05, clip_eps_high=0.2)
    # row 0 (s0 = 1.105 inside [.95, 1.2]): token losses −A·s0 = −1.1051709, 1.1051709,
    #   −2.2103418; mean −0.7367806121
    # row 1 (s1 = .9048 < .95): A = .5 → max(−.4524187, −.475) = −.4524187 (unclipped);
    #   A = −3 → max(2.7145123, 2.85) = 2.85 (clipped); mean (−.4524187 + 2.85)/2 = 1.1987906
    # (−0.7367806121 + 1.1987906455)/2 = 0.2310050167
    close(loss, 0.2310050167)
    # gradients −A·s/(|y_i|·G): row 0: −A·1.1051709/6; row 1 token 0: −.5·.9048374/4; token 1 0
    close(grad_of(loss, lp), [[-0.1841951530, 0.1841951530, -0.3683903060],
                              [-0.1131046773, 0.0, 0.0]])


# ------------------------------------------------------------------------------------ CISPO

# logprobs row 0 (−1, −2, −.5), ratios (1.1, 1.5, .7); row 1 (−.3, −1.2), ratios (.9, 1.4)
CISPO_LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], dtype=F64)
CISPO_RATIOS = [[1.1, 1.5, 0.7], [0.9, 1.4, 1.0]]


def cispo_inputs() -> tuple[Tensor, Tensor]:
    old = CISPO_LP - torch.tensor([[math.log(r) for r in row] for row in CISPO_RATIOS],
                                  dtype=F64)
    lp = CISPO_LP.masked_fill(MASK == 0, NAN).requires_grad_(True)
    return lp, old.masked_fill(MASK == 0, -INF)


def test_cispo_clips_the_detached_weight_and_keeps_every_tokens_gradient() -> None:
    lp, old = cispo_inputs()
    assert clip_range("cispo") == (1.0, 0.28)  # no lower bound; upper 1.28
    loss, metrics = compute_policy_loss(lp, old, ADV, MASK, policy_loss="cispo")
    # weights clip(ρ, 0, 1.28): (1.1, 1.28, .7), (.9, 1.28)
    # token losses −w·A·log π: 1.1, 2.56, .35 | −.9·−2·−.3 = −.54, −1.28·−2·−1.2 = −3.072
    # token-mean (4.01 − 3.612)/5 = .0796
    close(loss, 0.0796)
    assert metrics["clip_frac"] == pytest.approx(0.4, abs=TOL)  # 1.5 and 1.4
    # ∂/∂log π = −w·A/5: the clipped tokens keep a bounded gradient
    close(grad_of(loss, lp), [[-0.22, -0.256, -0.14], [0.36, 0.512, 0.0]])
    # PPO's clip drops the gradient of the token at 1.5 (A > 0) altogether
    ppo, _ = compute_policy_loss(lp, old, ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.28)
    assert float(grad_of(ppo, lp)[0, 1]) == 0.0


def test_cispo_lower_bound() -> None:
    lp, old = cispo_inputs()
    loss, metrics = compute_policy_loss(lp, old, ADV, MASK, policy_loss="cispo",
                                        clip_eps_low=0.2)
    # .7 now weighs .8: row 0's third token −.8·1·−.5 = .4 → (4.06 − 3.612)/5 = .0896
    close(loss, 0.0896)
    assert metrics["clip_frac"] == pytest.approx(0.6, abs=TOL)
    close(grad_of(loss, lp), [[-0.22, -0.256, -0.16], [0.36, 0.512, 0.0]])


# ------------------------------------------------------------------------------ corrections

# π_old/π_rollout per token: row 0 (1.8, 1.5, .4), sequence ratio 1.08; row 1 (3, 1), ratio 3.
# π_θ = π_old (ratio 1, PPO unclipped): each token's loss is −A·w, its gradient −A·w/5.
ROLLOUT_RATIOS = [[1.8, 1.5, 0.4], [3.0, 1.0, 1.0]]


def rollout_logprobs() -> Tensor:
    log_w = torch.tensor([[math.log(r) for r in row] for row in ROLLOUT_RATIOS], dtype=F64)
    return (OLD - log_w).masked_fill(MASK == 0, INF)


CORRECTION_CASES = {
    # weights (1.8, 1.5, .4), (min(3, 2), 1); −1.8 − 1.5 − .4 + 4 + 2 = 2.3
    "tis": (RolloutCorrection("tis", cap=2.0), [[1.8, 1.5, 0.4], [2.0, 1.0]], 0.46, None),
    # row weights 1.08 and min(3, 2); −1.08·3 + 2·2·2 = 4.76
    "seq_tis": (RolloutCorrection("seq_tis", cap=2.0), [[1.08] * 3, [2.0] * 2], 0.952, None),
    # row 1 (3 > 2) is dropped, row 0 weighs its ratio 1.08: −3.24
    "mis": (RolloutCorrection("mis", bounds=(0.5, 2.0)), [[1.08] * 3, [0.0] * 2], -0.648, 0.4),
    # tokens .4 and 3 are dropped, the rest weigh their ratio: −1.8 − 1.5 + 2·1 = −1.3
    "icepop": (RolloutCorrection("icepop", bounds=(0.5, 2.0)), [[1.8, 1.5, 0.0], [0.0, 1.0]],
               -0.26, 0.4),
}


@pytest.mark.parametrize("kind", list(CORRECTION_CASES))
def test_correction_weights_loss_and_gradient(kind: str) -> None:
    correction, rows, want_loss, want_masked = CORRECTION_CASES[kind]
    weights = [rows[0], [*rows[1], 0.0]]
    rollout = rollout_logprobs()
    got, dropped = correction_weights(OLD, rollout, MASK, correction)
    close(got, weights)
    masking = want_masked is not None
    assert dropped.tolist() == [[masking and w == 0.0 for w in row] + [False] * (3 - len(row))
                                for row in rows]
    lp = shifted([[0.0] * 3, [0.0] * 3])
    loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout,
                                        correction=correction)
    close(loss, want_loss)
    assert metrics["tis_mean"] == pytest.approx(sum(map(sum, rows)) / 5, abs=TOL)
    if want_masked is None:
        assert "is_masked_frac" not in metrics
    else:
        assert metrics["is_masked_frac"] == pytest.approx(want_masked, abs=TOL)
    adv = [1.0, -2.0]
    close(grad_of(loss, lp), [[-a * w / 5 for w in row] for a, row in zip(adv, weights,
                                                                           strict=True)])


def test_tis_cap_is_the_token_level_correction() -> None:
    lp = shifted([[0.0] * 3, [0.0] * 3])
    rollout = rollout_logprobs()
    short, _ = compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout, tis_cap=2.0)
    full, _ = compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout,
                                  correction=RolloutCorrection("tis", cap=2.0))
    assert float(short.detach()) == float(full.detach())
    with pytest.raises(ValueError, match="not both"):
        compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout, tis_cap=2.0,
                            correction=RolloutCorrection("seq_tis"))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compute_policy_loss(lp, OLD, ADV, MASK, correction=RolloutCorrection("mis"))


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "gspo", "cispo"])
def test_a_dropped_sequence_contributes_nothing(policy_loss: str) -> None:
    # mis drops row 1 (ratio 3): the loss and row 0's gradient are those of row 0 alone with
    # the same divisor, and row 1 gets no gradient whatever its logprobs.
    rollout = rollout_logprobs()
    mis = RolloutCorrection("mis", bounds=(0.5, 2.0))
    kwargs: dict[str, Any] = {"policy_loss": policy_loss, "clip_eps_low": 0.2, "clip_eps_high": 0.2,
                              "loss_agg": "token-mean", "num_tokens": 5.0}
    for moved in (0.0, 0.3):  # row 1's logprobs do not matter
        lp = shifted([[0.1, -0.1, 0.05], [moved, -moved, 0.0]])
        both, _ = compute_policy_loss(lp, OLD, ADV, MASK, rollout_logprobs=rollout,
                                      correction=mis, **kwargs)
        grad = grad_of(both, lp)
        assert grad[1].tolist() == [0.0, 0.0, 0.0]
        alone = lp.detach()[:1].clone().requires_grad_(True)
        one, _ = compute_policy_loss(alone, OLD[:1], ADV[:1], MASK[:1],
                                     rollout_logprobs=rollout[:1], correction=mis, **kwargs)
        close(both, float(one.detach()))
        torch.testing.assert_close(grad[:1], grad_of(one, alone), atol=1e-12, rtol=0)
    assert (grad[0] != 0).all()


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "cispo"])
def test_a_dropped_token_contributes_nothing(policy_loss: str) -> None:
    # icepop drops tokens (0, 2) and (1, 0): their logprobs move neither loss nor gradient.
    rollout = rollout_logprobs()
    icepop = RolloutCorrection("icepop", bounds=(0.5, 2.0))
    losses = []
    for moved in (0.0, 0.25):
        lp = shifted([[0.1, -0.1, moved], [moved, 0.05, 0.0]])
        loss, metrics = compute_policy_loss(lp, OLD, ADV, MASK, policy_loss=policy_loss,
                                            clip_eps_low=0.2, rollout_logprobs=rollout,
                                            correction=icepop)
        grad = grad_of(loss, lp)
        assert (grad[0, 2], grad[1, 0]) == (0.0, 0.0)
        assert (grad[0, :2] != 0).all()
        assert grad[1, 1] != 0
        assert metrics["is_masked_frac"] == pytest.approx(0.4, abs=TOL)
        losses.append(float(loss.detach()))
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)


def tis_reference(lp: Tensor, old: Tensor, rollout: Tensor, adv: Tensor, mask: Tensor,
                  low: float, high: float, cap: float) -> Tensor:
    """Token-level TIS-weighted PPO one token at a time: token-mean of
    max(−A·r, −A·clip(r, 1−low, 1+high)) · min(π_old/π_rollout, cap)."""
    terms = []
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            if not mask[i, j]:
                continue
            r = torch.exp(lp[i, j] - old[i, j])
            a = float(adv[i])
            w = min(math.exp(float(old[i, j]) - float(rollout[i, j])), cap)
            terms.append(torch.maximum(-a * r, -a * torch.clamp(r, 1 - low, 1 + high)) * w)
    return torch.stack(terms).sum() / len(terms)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_tis_matches_a_loop_over_tokens(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    b, n = 5, 6
    mask = torch.rand(b, n, generator=g) > 0.25
    mask[2] = False
    old = -torch.rand(b, n, generator=g, dtype=F64) * 3
    values = old + 0.2 * torch.randn(b, n, generator=g, dtype=F64)  # some ratios clip
    rollout = old + 0.8 * torch.randn(b, n, generator=g, dtype=F64)  # some weights cap
    adv = torch.randn(b, generator=g, dtype=F64)
    lp = values.masked_fill(~mask, NAN).requires_grad_(True)
    ref_lp = values.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(
        lp, old.masked_fill(~mask, -INF), adv, mask, clip_eps_low=0.2, clip_eps_high=0.28,
        rollout_logprobs=rollout.masked_fill(~mask, NAN), tis_cap=1.5)
    want = tis_reference(ref_lp, old, rollout, adv, mask, 0.2, 0.28, 1.5)
    close(loss, float(want.detach()))
    torch.testing.assert_close(grad_of(loss, lp), grad_of(want, ref_lp).masked_fill(~mask, 0.0),
                               atol=1e-9, rtol=1e-7)
    assert 0.0 < metrics["clip_frac"] < 1.0
    assert metrics["tis_mean"] < 1.5


# ----------------------------------------------------------------------------------- errors


def test_bad_settings_are_refused() -> None:
    lp = shifted([[0.0] * 3, [0.0] * 3])
    with pytest.raises(ValueError, match="policy loss"):
        compute_policy_loss(lp, OLD, ADV, MASK, policy_loss="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_eps"):
        clip_range("cispo", clip_eps_low=1.5)
    assert clip_range("ppo_clip", 0.1) == (0.1, 0.1)  # PPO's high follows its low
    assert clip_range("gspo", 1e-3) == (1e-3, 4e-4)
    bad_settings: list[tuple[dict[str, Any], str]] = [
        ({"kind": "tis", "cap": 0.0}, "cap"), ({"kind": "mis", "bounds": (1.2, 2.0)}, "bounds"),
        ({"kind": "icepop", "bounds": (0.5, 0.9)}, "bounds"),
        ({"kind": "mis", "bounds": (0.5, INF)}, "bounds"), ({"kind": "clip"}, "correction")]
    for bad, match in bad_settings:
        with pytest.raises(ValueError, match=match):
            RolloutCorrection(**bad)
