"""Balanced micro-batch splits: always a partition, close to optimal, better than naive."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.balance import imbalance, max_load, split_balanced, split_kk, split_lpt


def optimal_max_load(lengths: Sequence[int], k: int) -> int:
    """Exact optimum by trying every assignment (small inputs only)."""
    best = sum(lengths)
    for assign in itertools.product(range(k), repeat=len(lengths)):
        loads = [0] * k
        for n, part in zip(lengths, assign, strict=True):
            loads[part] += n
        best = min(best, max(loads))
    return best


def test_classic_example_by_hand() -> None:
    # {8,7,6,5,4} into 2: optimum 15 ({8,7} | {6,5,4}); LPT gets 17, Karmarkar-Karp 16.
    lengths = [8, 7, 6, 5, 4]
    assert optimal_max_load(lengths, 2) == 15
    assert split_lpt(lengths, 2) == [[0, 3, 4], [1, 2]]
    assert max_load(lengths, split_lpt(lengths, 2)) == 17
    kk = split_kk(lengths, 2)
    assert kk == [[0, 2], [1, 3, 4]]
    assert max_load(lengths, kk) == 16


def test_three_way_by_hand() -> None:
    lengths = [10, 10, 10, 1, 1, 1]
    for method in ("kk", "lpt"):
        parts = split_balanced(lengths, 3, method)
        assert sorted(max_load(lengths, [p]) for p in parts) == [11, 11, 11]


def test_shape_of_the_result() -> None:
    assert split_balanced([], 3) == [[], [], []]
    assert split_balanced([5, 1], 4) == [[0], [1], [], []]
    assert split_balanced([3, 1, 2], 1) == [[0, 1, 2]]
    assert split_balanced([0, 0, 0], 2, "lpt") == [[0, 2], [1]]
    with pytest.raises(ValueError, match="k must be >= 1"):
        split_balanced([1], 0)
    with pytest.raises(ValueError, match="non-negative"):
        split_balanced([1, -1], 2)
    with pytest.raises(ValueError, match="unknown method"):
        split_balanced([1], 1, "greedy")  # type: ignore[arg-type]


def test_imbalance() -> None:
    assert imbalance([4, 4], [[0], [1]]) == 1.0
    assert imbalance([6, 2], [[0], [1]]) == 1.5
    assert imbalance([], [[], []]) == 1.0


def test_kk_beats_naive_chunking_on_skewed_lengths() -> None:
    # Sorted, long-tailed response lengths: contiguous chunks put all long ones together.
    lengths = [2000 - 37 * i for i in range(48)]
    k = 4
    chunks = [list(range(i * 12, (i + 1) * 12)) for i in range(k)]
    assert imbalance(lengths, split_kk(lengths, k)) < 1.01
    assert imbalance(lengths, chunks) > 1.3


lengths_st = st.lists(st.integers(0, 1000), max_size=40)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 9), method=st.sampled_from(["kk", "lpt"]))
def test_result_is_a_partition(lengths: list[int], k: int, method: str) -> None:
    parts = split_balanced(lengths, k, method)  # type: ignore[arg-type]
    assert len(parts) == k
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
    assert all(p == sorted(p) for p in parts)
    nonempty = [p for p in parts if p]
    assert [p[0] for p in nonempty] == sorted(p[0] for p in nonempty)
    assert parts[len(nonempty):] == [[]] * (k - len(nonempty))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 40), c=st.integers(0, 9), k=st.integers(1, 8),
       method=st.sampled_from(["kk", "lpt"]))
def test_equal_lengths_split_into_equal_counts(n: int, c: int, k: int, method: str) -> None:
    sizes = [len(p) for p in split_balanced([c] * n, k, method)]  # type: ignore[arg-type]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=8), k=st.integers(2, 3))
def test_within_the_proven_bound_of_optimal(lengths: list[int], k: int) -> None:
    # Both heuristics: largest part <= (4/3 - 1/(3k)) x optimum (Graham; Michiels et al.).
    opt = optimal_max_load(lengths, k)
    bound = (4 / 3 - 1 / (3 * k)) * opt
    assert max_load(lengths, split_lpt(lengths, k)) <= bound + 1e-9
    assert max_load(lengths, split_kk(lengths, k)) <= bound + 1e-9


def test_kk_is_optimal_on_most_small_cases() -> None:
    # Deterministic sample of small instances: KK finds the optimum in the large majority and
    # has a smaller total largest-part than LPT over the sample.
    rng = random.Random(7)
    hits = 0
    kk_total = lpt_total = 0
    cases = 150
    for _ in range(cases):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(4, 8))]
        opt = optimal_max_load(lengths, 2)
        kk = max_load(lengths, split_kk(lengths, 2))
        hits += kk == opt
        kk_total += kk
        lpt_total += max_load(lengths, split_lpt(lengths, 2))
    assert hits >= 0.6 * cases
    assert kk_total <= lpt_total
