"""Invariances of the group advantage estimators and of the rollout corrections (hypothesis), the
torch-only import rule, and device agreement (CUDA when present)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flowrl.algorithms import (
    RolloutCorrection,
    compute_policy_loss,
    correction_weights,
    dr_grpo_advantages,
    filter_groups,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

F64 = torch.float64

# Rewards on a 0.25 grid keep every non-constant group's std >= ~0.1, so sums of normalized
# advantages are O(1) and a 1e-9 tolerance is meaningful.
rows = st.lists(
    st.tuples(st.integers(0, 5), st.integers(-16, 16).map(lambda k: k / 4)),
    min_size=1,
    max_size=40,
)


def _tensors(data: list[tuple[int, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([g for g, _ in data], dtype=torch.long)
    rewards = torch.tensor([r for _, r in data], dtype=F64)
    return rewards, ids


def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(ids.max()) + 1, dtype=F64).index_add(0, ids, values)


@settings(max_examples=150, deadline=None)
@given(rows, st.floats(-5, 5), st.floats(0.25, 4))
def test_group_advantage_invariances(
    data: list[tuple[int, float]], shift: float, scale: float
) -> None:
    rewards, ids = _tensors(data)
    grpo = grpo_advantages(rewards, ids, eps=0.0)
    dr = dr_grpo_advantages(rewards, ids)
    rloo = rloo_advantages(rewards, ids)
    for adv in (grpo, dr, rloo):
        assert torch.isfinite(adv).all()
        # zero-sum within every group
        torch.testing.assert_close(
            _group_sums(adv, ids), torch.zeros_like(_group_sums(adv, ids)), atol=1e-9, rtol=0
        )
    # RLOO is Dr.GRPO scaled by n/(n-1)
    n = torch.bincount(ids)[ids].to(F64)
    torch.testing.assert_close(rloo, dr * n / (n - 1).clamp(min=1), atol=1e-9, rtol=0)
    # shift invariance (all three) and scale behavior (GRPO invariant, Dr.GRPO/RLOO linear)
    moved = rewards * scale + shift
    torch.testing.assert_close(grpo_advantages(moved, ids, eps=0.0), grpo, atol=1e-7, rtol=0)
    torch.testing.assert_close(dr_grpo_advantages(moved, ids), dr * scale, atol=1e-7, rtol=0)
    torch.testing.assert_close(rloo_advantages(moved, ids), rloo * scale, atol=1e-7, rtol=0)
    # permutation equivariance: row order does not matter
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(len(data)))
    torch.testing.assert_close(grpo_advantages(rewards[perm], ids[perm], eps=0.0), grpo[perm])
    # GRPO advantages of a non-constant group have unbiased sample std 1 (eps=0)
    keep = filter_groups(rewards, ids)
    for g in keep.kept_groups.tolist():
        sel = grpo[ids == g]
        torch.testing.assert_close(sel.std(), torch.tensor(1.0, dtype=F64))
    # filter_groups keeps exactly the groups with a non-zero advantage somewhere
    nonzero = _group_sums(dr.abs(), ids) > 0
    present = torch.bincount(ids) > 0
    assert keep.kept_groups.tolist() == torch.nonzero(nonzero & present).flatten().tolist()


# Ragged rows of per-token log(π_old/π_rollout), padded into [B, T] by the test.
log_ratio_rows = st.lists(st.lists(st.floats(-3, 3), min_size=0, max_size=6), min_size=1,
                          max_size=6)


@settings(max_examples=150, deadline=None)
@given(log_ratio_rows, st.sampled_from(["tis", "seq_tis", "mis", "icepop"]), st.floats(1, 5),
       st.floats(0, 1), st.floats(1, 5))
def test_correction_weight_invariants(
    rows: list[list[float]], kind: str, cap: float, low: float, high: float
) -> None:
    assume(low < high)
    b, n = len(rows), max(1, max(len(r) for r in rows))
    mask = torch.zeros(b, n, dtype=torch.bool)
    log_w = torch.zeros(b, n, dtype=F64)
    for i, row in enumerate(rows):
        mask[i, : len(row)] = True
        log_w[i, : len(row)] = torch.tensor(row, dtype=F64)
    old = -torch.linspace(0.1, 5.0, b * n, dtype=F64).reshape(b, n)
    rollout = (old - log_w).masked_fill(~mask, float("nan"))  # padding is garbage
    correction = RolloutCorrection(kind, cap=cap, bounds=(low, high))  # type: ignore[arg-type]
    w, dropped = correction_weights(old, rollout, mask, correction)
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    assert (w[~mask] == 0).all()
    assert not dropped[~mask].any()
    if correction.masks:
        # kept samples weigh their ratio, inside the bounds; dropped ones weigh exactly 0
        assert (w[dropped] == 0).all()
        kept = mask & ~dropped
        assert (w[kept] >= low * (1 - 1e-12)).all()
        assert (w[kept] <= high * (1 + 1e-12)).all()
    else:
        assert not dropped.any()
        assert (w[mask] <= cap * (1 + 1e-12)).all()
        assert (w[mask] > 0).all()
    if kind in ("seq_tis", "mis"):  # one weight per sequence
        for i in range(b):
            row = w[i][mask[i]]
            assert (row == row[0]).all() if row.numel() else True
    # Samples drawn by π_old itself are not corrected.
    same, none_dropped = correction_weights(old, old, mask, correction)
    assert (same[mask] == 1).all()
    assert not none_dropped.any()


def test_import_pulls_in_nothing_but_torch() -> None:
    # Workers import these functions: importing them must load no other flowrl package,
    # no transport/workers code, and none of the heavy or networked dependencies.
    code = "import json, sys\nimport flowrl.algorithms\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    loaded = set(json.loads(out))
    ours = {m for m in loaded if m.split(".")[0] in {"flowrl", "workers", "transport"}}
    assert "flowrl.algorithms.losses" in ours
    assert {m for m in ours if m != "flowrl" and not m.startswith("flowrl.algorithms")} == set()
    assert loaded.isdisjoint({"zmq", "msgpack", "pydantic", "transformers", "aiohttp"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    b, n = 64, 257
    rewards = torch.randint(0, 3, (b,), generator=gen).to(torch.float32)
    ids = torch.randint(0, 12, (b,), generator=gen)
    mask = torch.rand(b, n, generator=gen) > 0.2
    old = -torch.rand(b, n, generator=gen) * 3
    lp = old + 0.1 * torch.randn(b, n, generator=gen)
    values = torch.randn(b, n, generator=gen)

    def run(device: str) -> list[torch.Tensor]:
        def d(x: torch.Tensor) -> torch.Tensor:
            return x.to(device)

        adv = grpo_advantages(d(rewards), d(ids))
        lpd = d(lp).requires_grad_(True)
        loss, _ = compute_policy_loss(
            lpd,
            d(old),
            adv,
            d(mask),
            clip_eps_high=0.28,
            rollout_logprobs=d(old) - 0.05,
            tis_cap=2.0,
            ref_logprobs=d(old),
            kl_coef=0.01,
        )
        loss.backward()  # type: ignore[no-untyped-call]
        assert lpd.grad is not None
        gae, ret = gae_advantages(d(values), d(values) * 0.5, d(mask), gamma=0.99, lam=0.95)
        rpp = reinforce_pp_advantages(d(rewards), d(mask), group_ids=d(ids), gamma=0.99)
        return [
            t.detach().cpu()
            for t in (adv, rloo_advantages(d(rewards), d(ids)), loss, lpd.grad, gae, ret, rpp)
        ]

    for a, c in zip(run("cpu"), run("cuda"), strict=True):
        torch.testing.assert_close(c, a, atol=1e-4, rtol=1e-4)
