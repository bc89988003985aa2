"""Handles: where one row of one field lives in a node's sample store.

A `Handle` is a plain tuple ``(node, segment, offset, dtype, shape)`` that travels as a msgpack
list and is validated on arrival (`Handle.from_wire`). Rows of one field of one put are packed
back to back, so the handles of a micro-batch read back in order form one contiguous byte
range: `contiguous_runs` finds such runs, so a read costs one operation per run, not per row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from transport import shm
from transport.errors import MalformedMessage

__all__ = [
    "DTYPES",
    "ITEMSIZE",
    "Handle",
    "Run",
    "contiguous_runs",
    "dtype_name",
    "single_run",
]

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""Every dtype the store holds, by wire name (the same names as `transport.codec`)."""

ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in DTYPES.items()}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_NDIM = 8


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}") from None


class Handle(NamedTuple):
    """Where one row of one field lives. Travels on the wire as a 5-element list."""

    node: str
    segment: str  # "" for a row of zero bytes, which references no memory
    offset: int  # bytes from the start of the segment
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @classmethod
    def from_wire(cls, value: Any) -> Handle:
        """Validate a decoded handle (a list or tuple) and return it; MalformedMessage if bad.

        Called once per row on every decoded message: kept to type checks and dict lookups
        (segment names are parsed once, then remembered).
        """
        if type(value) not in (list, tuple, cls) or len(value) != 5:
            raise MalformedMessage(f"a handle is a 5-element list, got {value!r:.200}")
        node, segment, offset, dtype, shape = value
        if type(node) is not str or type(segment) is not str or type(dtype) is not str:
            raise MalformedMessage("handle node, segment and dtype must be strings")
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is None:
            raise MalformedMessage(f"unknown dtype in handle: {dtype!r:.50}")
        if type(shape) not in (list, tuple) or len(shape) > _MAX_NDIM:
            raise MalformedMessage(f"bad handle shape: {shape!r:.200}")
        for d in shape:
            if type(d) is not int or d < 0:
                raise MalformedMessage(f"bad handle shape: {shape!r:.200}")
        if type(offset) is not int or offset < 0 or offset % itemsize:
            raise MalformedMessage(f"bad handle offset: {offset!r:.50}")
        if segment and segment not in _PUBLISHED:
            parsed = shm.SegmentName.parse(segment)
            if parsed is None or parsed.state:  # handles only name published segments
                raise MalformedMessage(f"bad segment name in handle: {segment!r:.200}")
            if len(_PUBLISHED) >= _PUBLISHED_MAX:
                _PUBLISHED.clear()
            _PUBLISHED.add(segment)
        return tuple.__new__(cls, (node, segment, offset, dtype, tuple(shape)))


# Segment names already seen to be well formed (a message names each one many times).
_PUBLISHED: set[str] = set()
_PUBLISHED_MAX = 4096


class Run(NamedTuple):
    """Rows ``[start, stop)`` of a handle list whose bytes are one contiguous range."""

    start: int
    stop: int
    node: str
    segment: str
    offset: int
    nbytes: int


def single_run(handles: Sequence[Handle]) -> tuple[Run, list[int]] | None:
    """(run, row lengths) when `handles` are non-empty 1-D rows of one field of one put, in
    order (the common case), checked with a few C-level passes; otherwise None."""
    nodes, segments, offsets, dtypes, shapes = zip(*handles, strict=False)
    count = len(offsets)
    if (
        not segments[0]
        or segments.count(segments[0]) != count
        or dtypes.count(dtypes[0]) != count
        or nodes.count(nodes[0]) != count
    ):
        return None
    itemsize = ITEMSIZE[dtypes[0]]
    start = offsets[0]
    if len(shapes[0]) == 1 and shapes.count(shapes[0]) == count:  # equal lengths
        lens = [shapes[0][0]] * count
        step = lens[0] * itemsize
        end = start + count * step
        if not step or offsets != tuple(range(start, end, step)):
            return None
    else:
        if set(map(len, shapes)) != {1}:
            return None
        lens = list(itertools.chain.from_iterable(shapes))
        ends = list(itertools.accumulate([n * itemsize for n in lens], initial=start))
        if ends[:-1] != list(offsets) or 0 in lens:
            return None
        end = ends[-1]
    return Run(0, count, nodes[0], segments[0], start, end - start), lens


def contiguous_runs(handles: Sequence[Handle]) -> list[Run]:
    """Group handles into maximal runs of back-to-back rows of one segment and dtype.

    Rows of one field of one put are contiguous, so a micro-batch read back in order is one run.
    Zero-byte rows never break a run; a run never starts or ends with one.
    """
    if not handles:
        return []
    single = single_run(handles)
    if single is not None:
        return [single[0]]
    runs: list[Run] = []
    start = last = -1
    node = segment = dtype = ""
    offset = end = 0
    for k, h in enumerate(handles):
        nbytes = math.prod(h.shape) * ITEMSIZE[h.dtype]
        if nbytes == 0:
            continue
        if (
            start >= 0
            and h.offset == end
            and h.segment == segment
            and h.dtype == dtype
            and h.node == node
        ):
            end += nbytes
            last = k
            continue
        if start >= 0:
            runs.append(Run(start, last + 1, node, segment, offset, end - offset))
        start = last = k
        node, segment, dtype = h.node, h.segment, h.dtype
        offset, end = h.offset, h.offset + nbytes
    if start >= 0:
        runs.append(Run(start, last + 1, node, segment, offset, end - offset))
    return runs
