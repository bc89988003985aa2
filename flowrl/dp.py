"""Data-parallel train steps: how the controller shares one step among N trainer ranks.

With ``trainer.ranks = N > 1`` every optimizer step is taken by N rank processes together: each
accumulates the gradients of its share of the step's micro-batches, the step's end all-reduces
the gradient sums and counts (``workers.distributed``), and every rank takes the same optimizer
step. The controller's side is this module, a pure state machine (no sockets, no clock):

- **Streaming.** While more than N of the step's groups are still to come, micro-batches of up
  to ``micro_batch`` groups are handed out as soon as they are ready, each to the rank that has
  been given the fewest tokens this step (the online form of LPT: the rows of a step arrive
  over time, so `flowrl.balance`'s offline split cannot wait for all of them). A rank whose
  queue is full is skipped, so a slow rank is not buried.
- **Closing round.** The step's last N groups are held until all N are ready and then go one
  to every rank, the largest to the rank with the fewest tokens (pairing sorted lists this way
  minimises the step's largest rank load for the given loads). Each of them carries
  ``step_end``: every rank gets exactly one step end per step, and at least one micro-batch.
- **Equal passes.** Sharded ranks (``trainer.sharding="fsdp2"``) gather parameters in every
  forward and scatter gradients in every backward, collectives that pair up only if every rank
  runs as many passes as every other. The step's end tells each rank the step's largest count
  of micro-batches on any rank (`passes`); a rank with fewer runs that many empty passes
  (no gradient) first.
- **Commit.** A step is committed once all N ranks reported its end (`merge_step_ends`): they
  must agree on the new version and on a checksum of their parameters, and exactly one of
  them (rank 0) exported the weights.

Guarantees: every group of a step is given to exactly one rank; every rank gets at least one
micro-batch of every step and exactly one step end; a step's tokens per rank are balanced
greedily, the last round optimally for the loads it finds. Needs ``groups_per_step >= N``
(`flowrl.recipe.TrainerConfig` checks ``micro_batch_groups * ranks <= groups_per_step``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["RankShares", "StepDivergence", "merge_step_ends", "pair_closing"]

T = TypeVar("T")


class StepDivergence(ValueError):
    """The ranks' reports of one step disagree: they no longer hold the same parameters."""


def pair_closing(
    loads: Mapping[str, int], items: Sequence[tuple[T, int]]
) -> list[tuple[str, T]]:
    """One item per rank: the heaviest item to the least loaded rank, and so on.

    ``loads`` maps each rank to its tokens so far and ``items`` are ``(item, tokens)`` pairs, as
    many as ranks. Among all one-to-one assignments this minimises the largest ``load + tokens``
    (an exchange argument: swapping any crossed pair never lowers the maximum).
    """
    if len(items) != len(loads):
        raise ValueError(f"{len(items)} items for {len(loads)} ranks: need one each")
    ranks = sorted(loads, key=lambda r: (loads[r], r))
    heavy_first = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    return [(rank, items[i][0]) for rank, i in zip(ranks, heavy_first, strict=True)]


class RankShares(Generic[T]):
    """Which rank gets each of one step's train micro-batches (see the module docstring).

    The controller asks `want` how many groups to request next; a streamed micro-batch goes to
    `choose`'s rank and is recorded with `add`; a closing-round micro-batch is given to `hold`,
    which returns the whole round's placement once it holds one per rank.
    """

    def __init__(self, ranks: int, groups_per_step: int, micro_batch: int) -> None:
        if ranks < 2:
            raise ValueError(f"data parallelism needs at least 2 ranks, got {ranks}")
        if groups_per_step < ranks:
            raise ValueError(f"groups_per_step={groups_per_step} leaves a rank of {ranks} "
                             "without a share of the step")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self.ranks = ranks
        self.groups_per_step = groups_per_step
        self.micro_batch = micro_batch
        #: tokens given to each rank in the current step.
        self.tokens: dict[str, int] = {}
        #: streamed micro-batches given to each rank in the current step.
        self.streamed: dict[str, int] = {}
        self._held: list[tuple[T, int]] = []

    def closing(self, groups_in_step: int) -> bool:
        """Whether the step's closing round has begun (only its last `ranks` groups are left)."""
        return self.groups_per_step - groups_in_step <= self.ranks

    def want(self, groups_in_step: int) -> int:
        """Groups to request next: a streamed micro-batch, or one group of the closing round."""
        left = self.groups_per_step - groups_in_step
        if left <= self.ranks:
            return 1
        return min(self.micro_batch, left - self.ranks)

    def choose(self, open_ranks: Sequence[str]) -> str | None:
        """The rank among ``open_ranks`` (those with room in their queue) given the fewest
        tokens this step; ties go to the first listed."""
        return min(open_ranks, key=lambda r: self.tokens.get(r, 0), default=None)

    def add(self, rank: str, tokens: int) -> None:
        """A streamed micro-batch of ``tokens`` went to ``rank``."""
        self.tokens[rank] = self.tokens.get(rank, 0) + tokens
        self.streamed[rank] = self.streamed.get(rank, 0) + 1

    def passes(self) -> int:
        """The current step's micro-batches on its busiest rank, counting the closing round
        (ask before the round is placed: placing it starts the next step)."""
        return 1 + max(self.streamed.values(), default=0)

    def hold(self, item: T, tokens: int, ranks: Sequence[str]) -> list[tuple[str, T]] | None:
        """Keep one closing-round micro-batch; with one per rank held, return where each goes
        (and start the next step), else None."""
        self._held.append((item, tokens))
        if len(self._held) < self.ranks:
            return None
        if len(ranks) != self.ranks:
            raise ValueError(f"{len(ranks)} ranks for a step of {self.ranks}")
        placed = pair_closing({r: self.tokens.get(r, 0) for r in ranks}, self._held)
        self.new_step()
        return placed

    @property
    def held(self) -> list[T]:
        """Closing-round micro-batches requested but not yet handed out."""
        return [item for item, _ in self._held]

    def new_step(self) -> list[T]:
        """Forget the current step (its end, or its abort); returns what was held."""
        held = self.held
        self._held.clear()
        self.tokens.clear()
        self.streamed.clear()
        return held


def merge_step_ends(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The one ``task_done`` report a data-parallel step commits, from every rank's step end.

    The ranks must agree on the new ``version`` and, when they report one, on the
    ``param_checksum`` metric; exactly one report carries ``weights``. The merged report is
    that one, its metrics extended with ``ranks`` and, when the ranks report their own
    ``rank_tokens``, ``rank_imbalance`` (the largest share over the mean; 1.0 is perfect).
    Raises `StepDivergence` otherwise.
    """
    if not reports:
        raise ValueError("no step-end reports to merge")
    versions = sorted({r.get("version") for r in reports}, key=repr)
    if len(versions) != 1:
        raise StepDivergence(f"data-parallel ranks ended the step at different versions "
                             f"{versions}")
    sums = [(r.get("metrics") or {}).get("param_checksum") for r in reports]
    if len(set(sums)) != 1:
        raise StepDivergence(f"data-parallel ranks diverged at version {versions[0]}: "
                             f"parameter checksums {sums}")
    # Colocated placement announces a version served in place with empty weights.
    exporters = [r for r in reports if r.get("weights") is not None]
    if len(exporters) != 1:
        raise StepDivergence(f"{len(exporters)} ranks exported weights for version "
                             f"{versions[0]}; exactly one (rank 0) must")
    main = exporters[0]
    metrics = dict(main.get("metrics") or {})
    metrics["ranks"] = float(len(reports))
    shares = [float((r.get("metrics") or {}).get("rank_tokens", 0.0)) for r in reports]
    metrics.pop("rank_tokens", None)
    if sum(shares) > 0:
        metrics["rank_imbalance"] = max(shares) * len(shares) / sum(shares)
    return {**main, "metrics": metrics}
