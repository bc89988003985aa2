"""Dynamic sampling (DAPO): keep only the groups whose rewards carry a learning signal.

A group whose rewards are all equal (all correct, all wrong, or a single sample) has zero
group-relative advantage, so it contributes no policy gradient and only dilutes the batch.
``filter_groups`` marks such groups; the controller drops them and generates replacement prompts
until the batch holds enough informative groups. Vectorized over rows (no Python loop), for
groups of any size in any order. Imports torch only.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from ._common import flatten_groups, group_stats


class GroupFilter(NamedTuple):
    """Result of ``filter_groups``."""

    keep_rows: Tensor  # [B] bool: the row belongs to a kept group
    kept_groups: Tensor  # [K] ids of the kept groups, ascending
    dropped_groups: Tensor  # [D] ids of the dropped groups, ascending


def filter_groups(rewards: Tensor, group_ids: Tensor, *, min_spread: float = 0.0) -> GroupFilter:
    """Keep a group iff ``max(rewards) − min(rewards) > min_spread`` within it.

    The default ``min_spread = 0`` drops exactly the zero-variance groups (DAPO); groups of one
    are always dropped. ``rewards`` and ``group_ids`` are ``[B]``.
    """
    if min_spread < 0:
        raise ValueError(f"min_spread must be >= 0, got {min_spread}")
    flat, ids = flatten_groups(rewards.detach(), group_ids)
    st = group_stats(flat, ids)
    keep = st.spread > min_spread
    return GroupFilter(keep[st.row_group], st.ids[keep], st.ids[~keep])
