"""Split a batch into k micro-batches of balanced token count.

`split_balanced(lengths, k)` returns k lists of indices into `lengths` that partition
`range(len(lengths))`: every index appears exactly once, each list is sorted, and lists are
ordered by their smallest index (empty lists, when there are fewer rows than k, come last). The
objective is the largest micro-batch's token sum, which bounds a data-parallel step's time.

Two heuristics, both deterministic:

- ``"lpt"`` — greedy longest-processing-time: place rows longest first on the lightest
  micro-batch. Largest sum at most (4/3 - 1/(3k)) x optimal (Graham, 1969).
- ``"kk"`` — Karmarkar–Karp largest differencing, k-way: repeatedly merge the two partial
  partitions with the largest spread, heaviest part with lightest. Usually much closer to the
  optimum than LPT, with the same worst-case bound (Michiels et al., 2007).

Both run in O(n log n + n k log k).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

__all__ = ["imbalance", "max_load", "split_balanced", "split_kk", "split_lpt"]

Method = Literal["kk", "lpt"]


def _check(lengths: Sequence[int], k: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    for n in lengths:
        if n < 0:
            raise ValueError(f"lengths must be non-negative, got {n}")


def _finish(parts: list[list[int]], k: int) -> list[list[int]]:
    out = [sorted(p) for p in parts if p]
    out.sort(key=lambda p: p[0])
    out.extend([] for _ in range(k - len(out)))
    return out


def split_lpt(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Greedy LPT: longest rows first, each onto the currently lightest micro-batch."""
    _check(lengths, k)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # (load, rows, part): on equal load the part with fewer rows, then the lower number.
    heap = [(0, 0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, count, j = heapq.heappop(heap)
        parts[j].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, j))
    return _finish(parts, k)


def split_kk(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Karmarkar–Karp k-way differencing."""
    _check(lengths, k)
    if not lengths:
        return [[] for _ in range(k)]
    # A partial partition is k (sum, indices) parts sorted heaviest first; its spread is
    # heaviest - lightest. The heap pops the largest spread first (ties: the oldest entry).
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for seq, i in enumerate(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))):
        parts: list[tuple[int, list[int]]] = [(lengths[i], [i])]
        parts.extend((0, []) for _ in range(k - 1))
        heap.append((-lengths[i], seq, parts))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # Heaviest of a with lightest of b, and so on: the spreads cancel.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        # Heaviest first; on equal sums more rows first, so ties also even out row counts.
        merged.sort(key=lambda p: (-p[0], -len(p[1])))
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], seq, merged))
        seq += 1
    return _finish([idx for _, idx in heap[0][2]], k)


def split_balanced(lengths: Sequence[int], k: int, method: Method = "kk") -> list[list[int]]:
    """Partition row indices into `k` micro-batches of balanced total length (see module doc)."""
    if method == "kk":
        return split_kk(lengths, k)
    if method == "lpt":
        return split_lpt(lengths, k)
    raise ValueError(f"unknown method {method!r}; use 'kk' or 'lpt'")


def max_load(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> int:
    """The largest micro-batch token sum."""
    return max((sum(lengths[i] for i in p) for p in parts), default=0)


def imbalance(lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """Largest micro-batch sum over the mean one (1.0 is perfect balance)."""
    total = sum(lengths)
    if not parts or total == 0:
        return 1.0
    return max_load(lengths, parts) * len(parts) / total
