"""Writing a micro-batch into one segment: layout, the one copy per field, and the handles.

Each field is packed as one buffer (rows back to back, the buffer aligned to 64 bytes), fields
one after another in one segment. `SegmentWriter.write` fills a granted segment under its
temporary (``.tmp``) or pooled (``.pool``) name and renames it to its published name only once
every byte is written, so no reader can ever see a half-written row.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, TypeAlias

from transport import shm
from transport.handles import DTYPES, ITEMSIZE, Handle, dtype_name
from transport.reading import MappingCache

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = [
    "FieldData",
    "FieldPlan",
    "Grant",
    "SegmentWriter",
    "count_refs",
    "make_handles",
    "plan_fields",
    "size_class",
    "write_field",
]

_ALIGN = 64  # each field buffer starts on a cache line, so every dtype view is aligned

FieldData: TypeAlias = "Sequence[torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | torch.Tensor"
"""A field of one micro-batch: a list of per-row tensors (any shapes, one dtype), a
``(padded, lengths)`` tuple (row i is ``padded[i, :lengths[i]]``), or one tensor whose rows are
its slices along dim 0. A tuple is always read as a (padded, lengths) pair."""


@dataclass(frozen=True, slots=True)
class Grant:
    """Capacity reserved for one put: write `size` bytes fresh, or into pooled segment `pool`."""

    id: int
    size: int
    pool: str | None


def size_class(nbytes: int) -> int:
    """Segment size for `nbytes`: whole pages, rounded up to 1/8 steps of a power of two above
    64 KiB, so that micro-batches of similar size reuse each other's pooled segments."""
    size = shm.round_size(nbytes)
    if size <= 16 * shm.PAGE:
        return size
    step = 1 << (size.bit_length() - 4)
    return -(-size // step) * step


@dataclass(slots=True)
class FieldPlan:
    """Where one field goes in the segment, and where its rows come from."""

    name: str
    dtype: str
    shapes: list[tuple[int, ...]]
    numels: list[int]
    total: int  # elements
    offset: int = 0  # bytes from the segment start
    uniform: tuple[int, ...] | None = None  # the shape of every row, when they share one
    rows: Sequence[torch.Tensor] | None = None
    batch: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def _plan_field(name: str, data: FieldData) -> FieldPlan:
    if isinstance(data, tuple):
        if len(data) != 2 or not all(isinstance(t, torch.Tensor) for t in data):
            raise TypeError(f"field {name!r}: a tuple must be (padded, lengths) tensors")
        padded, lengths = data
        if padded.dim() < 2 or lengths.shape != padded.shape[:1]:
            raise ValueError(f"field {name!r}: need padded [B, L, ...] and lengths [B]")
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(f"field {name!r}: lengths must be integers")
        width, trail = padded.shape[1], tuple(padded.shape[2:])
        lens = lengths.tolist()
        inner = math.prod(trail)
        count = len(lens)
        if count and lens.count(width) == count:  # every row full: the batch as it is
            row = (width, *trail)
            plan = FieldPlan(
                name,
                dtype_name(padded.dtype),
                [row] * count,
                [width * inner] * count,
                padded.numel(),
                uniform=row,
            )
            plan.batch, plan.lengths = padded, lengths
            return plan
        if lens and (min(lens) < 0 or max(lens) > width):
            raise ValueError(f"field {name!r}: lengths must lie in [0, {width}]")
        numels = lens if inner == 1 else [n * inner for n in lens]
        # zip(lens) makes the 1-tuples in C: a put makes a shape per row
        shapes: list[tuple[int, ...]] = (
            list(zip(lens, strict=True)) if not trail else [(n, *trail) for n in lens]
        )
        plan = FieldPlan(name, dtype_name(padded.dtype), shapes, numels, sum(numels))
        plan.batch, plan.lengths = padded, lengths
        return plan
    if isinstance(data, torch.Tensor):
        if data.dim() == 0:
            raise ValueError(f"field {name!r}: a batch tensor needs a row dimension")
        row, count = tuple(data.shape[1:]), data.shape[0]
        plan = FieldPlan(
            name,
            dtype_name(data.dtype),
            [row] * count,
            [math.prod(row)] * count,
            data.numel(),
            uniform=row,
        )
        plan.batch = data
        return plan
    rows = list(data)
    if not all(isinstance(r, torch.Tensor) for r in rows):
        raise TypeError(f"field {name!r}: rows must be tensors")
    dtypes = {r.dtype for r in rows}
    if len(dtypes) > 1:
        raise TypeError(f"field {name!r}: rows have different dtypes {sorted(map(str, dtypes))}")
    numels = [r.numel() for r in rows]
    dtype = dtype_name(rows[0].dtype) if rows else "uint8"
    shapes = [tuple(r.shape) for r in rows]
    plan = FieldPlan(name, dtype, shapes, numels, sum(numels))
    if shapes and shapes.count(shapes[0]) == len(shapes):
        plan.uniform = shapes[0]
    plan.rows = rows
    return plan


def plan_fields(fields: Mapping[str, FieldData]) -> tuple[list[FieldPlan], int]:
    """Lay the fields out back to back (each aligned); return the plans and the bytes needed."""
    plans = [_plan_field(name, data) for name, data in fields.items()]
    end = 0
    for plan in plans:
        plan.offset = -(-end // _ALIGN) * _ALIGN
        end = plan.offset + plan.total * ITEMSIZE[plan.dtype]
    return plans, end


def write_field(plan: FieldPlan, segment: torch.Tensor) -> None:
    """Copy one field into `segment` (a uint8 tensor over the mapping): exactly one copy."""
    if plan.total == 0:
        return
    with torch.no_grad():  # values that require grad are stored as values, no graph attached
        _copy_field(plan, segment)


def _copy_field(plan: FieldPlan, segment: torch.Tensor) -> None:
    nbytes = plan.total * ITEMSIZE[plan.dtype]
    batch = plan.batch
    if (
        batch is not None
        and (plan.lengths is None or plan.total == batch.numel())
        and batch.device.type == "cpu"
        and batch.layout == torch.strided
        and batch.is_contiguous()
    ):  # the common case: a whole batch in memory, as it is
        _copy_bytes(segment, plan.offset, batch, nbytes)
        return
    flat = segment[plan.offset : plan.offset + nbytes].view(DTYPES[plan.dtype])
    if plan.rows is not None:
        rows = plan.rows
        if all(r.device.type == "cpu" for r in rows):
            parts = rows if all(r.dim() == 1 for r in rows) else [r.reshape(-1) for r in rows]
            torch.cat(list(parts), out=flat)
        else:  # straight from the device into shared memory, row by row
            starts = itertools.accumulate(plan.numels, initial=0)
            for row, start, n in zip(rows, starts, plan.numels, strict=False):
                flat[start : start + n].copy_(row.reshape(-1))
        return
    assert batch is not None
    if plan.lengths is None or plan.total == batch.numel():
        flat.view(batch.shape).copy_(batch)
        return
    width = batch.shape[1]
    lengths = plan.lengths.to(batch.device)
    mask = torch.arange(width, device=batch.device) < lengths[:, None]
    mask = mask.view(*mask.shape, *([1] * (batch.dim() - 2)))
    if batch.device.type == "cpu":
        torch.masked_select(batch, mask, out=flat)
    else:
        flat.copy_(torch.masked_select(batch, mask))


def _copy_bytes(segment: torch.Tensor, offset: int, src: torch.Tensor, nbytes: int) -> None:
    """Copy the `nbytes` bytes of contiguous CPU tensor `src` into uint8 `segment` at `offset`.

    libc's memmove writes memory that is not in the caches (a recycled segment, most of the
    time) about a quarter faster than torch's copy here; both bounds are checked first."""
    if (
        offset < 0
        or offset + nbytes > segment.numel()
        or src.numel() * src.element_size() != nbytes
        or not segment.is_contiguous()
    ):
        raise ValueError(f"{nbytes} bytes do not fit at {offset} in {segment.numel()}")
    if nbytes:
        ctypes.memmove(segment.data_ptr() + offset, src.data_ptr(), nbytes)


def make_handles(node: str, segment: str, plans: list[FieldPlan]) -> dict[str, list[Handle]]:
    """One handle per row and field; rows of zero bytes name no segment."""
    # A put makes a handle per row and field: build them with C-level iterators, skipping
    # NamedTuple.__new__'s Python frame.
    new = functools.partial(tuple.__new__, Handle)
    out: dict[str, list[Handle]] = {}
    for plan in plans:
        itemsize, numels = ITEMSIZE[plan.dtype], plan.numels
        shape = plan.uniform
        if shape is not None and numels and numels[0]:  # one shape: one step apart
            step, count = numels[0] * itemsize, len(numels)
            rows = zip(
                repeat(node),
                repeat(segment),
                range(plan.offset, plan.offset + step * count, step),
                repeat(plan.dtype),
                repeat(shape),
            )
            out[plan.name] = list(map(tuple.__new__, repeat(Handle), rows))
            continue
        offsets = itertools.accumulate(
            map(operator.mul, numels, repeat(itemsize)), initial=plan.offset
        )
        if 0 not in numels:
            rows = zip(repeat(node), repeat(segment), offsets, repeat(plan.dtype), plan.shapes)
            out[plan.name] = list(map(new, rows))
            continue
        out[plan.name] = [
            new((node, segment if n else "", off if n else 0, plan.dtype, shape))
            for off, n, shape in zip(offsets, numels, plan.shapes, strict=False)
        ]
    return out


def count_refs(plans: list[FieldPlan]) -> int:
    """Handles with bytes: what a segment's reference count starts at."""
    return sum(len(plan.numels) - plan.numels.count(0) for plan in plans)


class SegmentWriter:
    """Fills segments under one store's names on behalf of the calling process.

    `mappings` keeps this process's shared mappings of the segments it wrote: when the store
    hands one back from its pool, rewriting it costs no mapping and no page fault.
    """

    def __init__(self, run_id: str, owner: shm.Owner, mappings: MappingCache | None) -> None:
        self._prefix = shm.owner_prefix(run_id, owner)
        self._pid = os.getpid()
        self._seq = itertools.count()
        self._mappings = mappings

    def write(
        self, grant: Grant, plans: list[FieldPlan], data: torch.Tensor | None = None
    ) -> tuple[str, torch.Tensor]:
        """Write the planned fields into the granted segment and publish it.

        `data` is the caller's own uint8 view of the granted pool segment, if it has one.
        Returns the published name and a uint8 view of the segment (shared, writable).
        """
        final = f"{self._prefix}{self._pid}-{next(self._seq)}"
        work = f"{final}.tmp" if grant.pool is None else grant.pool
        try:
            if grant.pool is None:
                mapping = shm.create(work, grant.size)
                if self._mappings is not None:
                    data = self._mappings.insert(work, mapping)
                else:
                    data = torch.frombuffer(mapping, dtype=torch.uint8)
            elif data is None:
                if self._mappings is not None:
                    data = self._mappings.data(work)
                else:
                    data = torch.frombuffer(shm.map_shared(work), dtype=torch.uint8)
            for plan in plans:
                write_field(plan, data)
            shm.rename(work, final)
        except BaseException:
            if grant.pool is None:
                shm.unlink(work)
            raise
        return final, data
