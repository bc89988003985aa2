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

An engine may hold the weights whole, or split for tensor parallelism. `tp_slice` is one TP
rank's part of a whole Qwen2/Llama tensor, as Megatron and vLLM split it: column-parallel
projections (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``: weight and bias)
on dim 0, row-parallel ones (``o_proj``, ``down_proj``) on dim 1 with their bias whole (added
once after the ranks' partial sums), the vocabulary (``embed_tokens``, ``lm_head``) on dim 0,
norms whole. `tp_copy_into` is a bucket sink that copies each TP rank's slices (views, no
copy of their own) into that rank's tensors in place, so that the memory beyond the targets
stays one bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from workers.distributed import full_tensor

__all__ = [
    "BucketSink", "copy_into", "export_bucketed", "plan_buckets", "tp_copy_into", "tp_slice",
    "tp_split_dim", "whole_copy",
]

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


# ---- tensor-parallel split -------------------------------------------------------------------

#: modules whose output features are split across TP ranks (weight and bias on dim 0)
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
#: modules whose input features are split (weight on dim 1; the bias is added once, whole)
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
#: modules split over the vocabulary (dim 0); a real engine pads the vocabulary to a multiple
#: of the TP size first
VOCAB_PARALLEL = frozenset({"embed_tokens", "lm_head"})
#: the projections split by attention heads
_HEADED = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def tp_split_dim(name: str) -> int | None:
    """The dimension along which a whole Qwen2/Llama tensor named ``name`` (its Hugging Face
    name, such as ``model.layers.0.self_attn.q_proj.weight``) is split across TP ranks, or
    None when every rank holds it whole (norms, a row-parallel bias). ValueError for a name
    this layout does not know, rather than a silent replica."""
    parts = name.split(".")
    if len(parts) < 2:
        raise ValueError(f"{name}: not a module's parameter")
    module, kind = parts[-2], parts[-1]
    if "norm" in module:
        return None
    if module in COLUMN_PARALLEL and kind in ("weight", "bias"):
        return 0
    if module in ROW_PARALLEL and kind in ("weight", "bias"):
        return 1 if kind == "weight" else None
    if module in VOCAB_PARALLEL and kind == "weight":
        return 0
    raise ValueError(f"{name}: no tensor-parallel layout for this parameter (Qwen2/Llama "
                     f"names only)")


def tp_slice(name: str, whole: Tensor, rank: int, size: int, *,
             head_dim: int | None = None) -> Tensor:
    """TP rank ``rank`` of ``size``'s part of the whole tensor ``name`` (`tp_split_dim`): a view
    of ``whole``, contiguous ranks' parts in rank order. ValueError when the split dimension
    does not divide by ``size``, or, with ``head_dim``, when an attention projection's part
    would cut a head (the heads, or the key/value heads, must divide by ``size``)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size, got rank {rank} of {size}")
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return whole
    if dim >= whole.dim():
        raise ValueError(f"{name}: split on dim {dim}, but the tensor has shape "
                         f"{tuple(whole.shape)}")
    length = whole.shape[dim]
    if length % size:
        raise ValueError(f"{name}: dim {dim} of {tuple(whole.shape)} ({length}) does not divide "
                         f"by the tensor-parallel size {size}")
    part = length // size
    module = name.split(".")[-2]
    if head_dim is not None and module in _HEADED and part % head_dim:
        raise ValueError(f"{name}: {length // head_dim} heads of {head_dim} do not divide by "
                         f"the tensor-parallel size {size}")
    return whole.narrow(dim, rank * part, part)


def tp_copy_into(targets: Sequence[Mapping[str, Tensor]], *,
                 head_dim: int | None = None) -> BucketSink:
    """A sink that copies each whole tensor of a bucket, split for ``len(targets)`` TP ranks
    (`tp_slice`), into ``targets[rank][name]`` in place: each rank's own parameters (or views
    into an engine's fused ones, such as a slice of vLLM's ``qkv_proj``). The slices are
    views: nothing is allocated beyond the bucket. KeyError for a name without a target,
    ValueError for another shape or a split that does not divide."""
    size = len(targets)
    if size < 1:
        raise ValueError("need the targets of at least one TP rank")

    def sink(bucket: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, value in bucket.items():
                for rank, ranks_targets in enumerate(targets):
                    part = tp_slice(name, value, rank, size, head_dim=head_dim)
                    target = ranks_targets[name]
                    if target.shape != part.shape:
                        raise ValueError(f"{name}: TP rank {rank}'s part "
                                         f"{tuple(part.shape)} into {tuple(target.shape)}")
                    target.copy_(part)

    return sink
