"""Exporting whole weights from the training layout one bucket at a time.

A sharded trainer (FSDP2: each rank holds 1/N of every parameter) publishes whole tensors.
Gathering the whole model first would hold a second, whole copy of it in the trainer's memory
while it is written out. `export_bucketed` gathers one bucket of parameters (whole tensors,
about ``bucket_bytes``), hands it to a sink (the node's store, an engine's weights in place
through `copy_into`, or nothing on a rank that only takes part in the gathers), drops it and
goes on to the next: the memory held beyond the destination at any moment is one bucket plus
one tensor's gather, not the model.

The buckets follow the parameters' order; a tensor larger than ``bucket_bytes`` is a bucket on
its own. Every rank must call `export_bucketed` with the same tensors and bucket size: each
sharded tensor's gather is a collective. The values are those of a whole gather, bit for bit
(the same gather and copy per tensor; ``tests/test_resharding.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from workers.distributed import full_tensor

__all__ = ["BucketSink", "copy_into", "export_bucketed", "plan_buckets", "whole_copy"]

#: takes one bucket of whole CPU tensors; the exporter drops its reference after the call.
BucketSink = Callable[[dict[str, Tensor]], None]


def plan_buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """The names of (name, bytes) pairs cut, in order, into runs of at most ``bucket_bytes``
    (a larger tensor alone in its own run)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def whole_copy(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` whole (gathered when it is a shard: a collective), as a contiguous CPU tensor of
    its own (a later step does not change it)."""
    whole = full_tensor(t.detach())
    # A gather over several ranks is a fresh tensor: no second copy of it when it already is
    # what is asked for. A local tensor (or a one-rank shard) may be the parameter itself.
    fresh = isinstance(t, DTensor) and t.device_mesh.size() > 1
    return whole.to("cpu", dtype=dtype, copy=not fresh).contiguous()


def copy_into(targets: Mapping[str, Tensor]) -> BucketSink:
    """A sink that copies each tensor of a bucket into ``targets[name]`` in place (an engine's
    own parameters, or buffers allocated beforehand): the export then adds no memory beyond
    the bucket. KeyError for a name without a target, ValueError for another shape."""

    def sink(bucket: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, value in bucket.items():
                target = targets[name]
                if target.shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} into "
                                     f"{tuple(target.shape)}")
                target.copy_(value)

    return sink


def _nbytes(t: Tensor, dtype: torch.dtype | None) -> int:
    # A DTensor's numel is the whole tensor's.
    return t.numel() * (dtype or t.dtype).itemsize


def export_bucketed(
    named: Sequence[tuple[str, Tensor]], bucket_bytes: int, sink: BucketSink,
    dtype: torch.dtype | None = None,
) -> int:
    """Hand ``named``'s tensors whole to ``sink`` in buckets of about ``bucket_bytes``; returns
    the number of buckets. See the module docstring."""
    tensors = dict(named)
    buckets = plan_buckets([(n, _nbytes(t, dtype)) for n, t in named], bucket_bytes)
    with torch.no_grad():
        for names in buckets:
            bucket = {n: whole_copy(tensors[n], dtype) for n in names}
            sink(bucket)
            del bucket  # before the next gather: one bucket at a time
    return len(buckets)
