"""Reading rows back: zero-copy views, one-copy padded batches, and this process's mappings.

Any process on a node can read any published segment of that node by name, without asking
the store: `local_get` returns views over a fresh copy-on-write mapping (no copy; a caller that
writes into its views changes only its own pages), `local_get_padded` copies each contiguous
run into one padded batch tensor (one copy). Reads of `transport.handles.Rows` skip the check
that the rows form one run: it was made when the `Rows` was.

`MappingCache` keeps a process's mappings by inode. The store recycles freed segments (the same
file under a new name), so in steady state a reader finds the file already mapped and its page
tables populated: a read costs one `stat` (an `access`, for a name it saw before) instead of a
mapping and a page fault per 4 KiB.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from transport import shm
from transport.errors import UnknownSegment
from transport.handles import DTYPES, ITEMSIZE, Handle, Run, contiguous_runs, single_run

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "Mapped",
    "MappingCache",
    "cached_padded",
    "local_get",
    "local_get_padded",
    "map_runs",
    "padded_from_runs",
    "views_from_runs",
]


#: bytes of mappings one cache keeps by default: two versions of a ~500 MB model's weights, so a
#: recycled weight segment (same inode) is found mapped instead of faulted in again.
DEFAULT_CACHE_BYTES = 1 << 30


class MappingCache:
    """This process's mappings of segment files, keyed by inode, least recently used out first.

    A cached mapping pins its file's memory until evicted, even after the store unlinked it:
    `max_bytes` bounds that. Read mappings (``writable=False``) are shared and read-only: they
    see what writers put into a recycled segment, and a write through one (a caller writing
    into a `StoreClient.get_readonly` view) is a segfault, never a stale private page left in
    the cache. Views a caller may write into come from fresh copy-on-write mappings instead.
    A cached inode cannot be reused by another file: the mapping holds the file.

    It also remembers which inode each name it looked up had. Segment names are never reused
    (a freed segment is renamed away; recycled, it is published under a new name), so while
    a known name exists it is the file looked at before: looking it up again costs an `access`
    of the name (which is what makes a freed handle fail), not a `stat` and a search.
    """

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, *, writable: bool = False) -> None:
        self.max_bytes = max_bytes
        self.writable = writable
        self._entries: OrderedDict[tuple[int, int], Mapped] = OrderedDict()
        self._bytes = 0
        # name -> (path, inode key), oldest first; bounded by _NAMES_MAX
        self._names: dict[str, tuple[str, tuple[int, int]]] = {}

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the mappings held (evicted ones live on while views of them do)."""
        return self._bytes

    def data(self, name: str) -> torch.Tensor:
        """A uint8 view of the whole segment `name`; UnknownSegment if it does not exist."""
        return self.lookup(name).data

    def typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A `dtype` view of the whole segment `name` (cached, like the mapping)."""
        return self.lookup(name).view(dtype)

    def lookup(self, name: str) -> Mapped:
        """The mapping of segment `name`, found by its inode; UnknownSegment if the name does
        not exist (any more: a freed segment is renamed away)."""
        known = self._names.get(name)
        if known is not None:
            path, key = known
            hit = self._entries.get(key)
            if hit is not None:  # still mapped: the inode cannot have changed hands
                if not os.access(path, os.F_OK):
                    del self._names[name]
                    raise UnknownSegment(f"segment {name!r} does not exist (freed?)")
                self._entries.move_to_end(key)
                return hit
        path = shm.path_of(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise UnknownSegment(f"segment {name!r} does not exist (freed?)") from None
        key = (st.st_dev, st.st_ino)
        hit = self._entries.get(key)
        if hit is not None and hit.data.numel() == st.st_size:
            self._entries.move_to_end(key)
        else:
            try:  # names are never reused: if it opens, it is the file just looked at
                mapping = shm.map_shared(name) if self.writable else shm.map_readonly(name)
            except FileNotFoundError:
                raise UnknownSegment(f"segment {name!r} does not exist (freed?)") from None
            hit = self._add(key, mapping)
        if len(self._names) >= _NAMES_MAX:
            del self._names[next(iter(self._names))]
        self._names[name] = (path, key)
        return hit

    def insert(self, name: str, mapping: mmap.mmap) -> torch.Tensor:
        """Cache `mapping` (of segment `name`, just created); return its uint8 view."""
        st = os.stat(shm.path_of(name))
        return self._add((st.st_dev, st.st_ino), mapping).data

    def _add(self, key: tuple[int, int], mapping: mmap.mmap) -> Mapped:
        with warnings.catch_warnings():
            # torch warns that it cannot mark a read-only buffer's tensor read-only: the
            # mapping's protection is what keeps it unwritten.
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapping, dtype=torch.uint8)
        entry = Mapped(data, {}, {})
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.data.numel()
        self._entries[key] = entry
        self._bytes += entry.data.numel()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.data.numel()  # unmapped once no view of it is left
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._names.clear()
        self._bytes = 0


_NAMES_MAX = 4096  # names a cache remembers: a few puts' worth of names per mapping


class Mapped(NamedTuple):
    """One segment as this process maps it."""

    data: torch.Tensor  # uint8 over the whole mapping
    typed: dict[torch.dtype, torch.Tensor]  # views of `data` by dtype, made on first use
    # [count, width] views by (dtype, first element, count, width), made on first use: a
    # recycled segment is rewritten with the same layout, put after put
    blocks: dict[tuple[torch.dtype, int, int, int], torch.Tensor]

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """A `dtype` view of the whole segment (made once)."""
        found = self.typed.get(dtype)
        if found is None:
            found = self.typed[dtype] = self.data.view(dtype)
        return found

    def block(self, dtype: torch.dtype, start: int, count: int, width: int) -> torch.Tensor:
        """A ``[count, width]`` view of the `dtype` elements from element `start` on (made
        once per layout); ValueError if they do not lie inside the segment."""
        key = (dtype, start, count, width)
        found = self.blocks.get(key)
        if found is None:
            typed = self.view(dtype)
            if start < 0 or start + count * width > typed.numel():
                raise ValueError(f"rows {start}+{count}x{width} outside the segment")
            if len(self.blocks) >= _BLOCKS_MAX:
                self.blocks.clear()
            found = torch.as_strided(typed, (count, width), (width, 1), start)
            self.blocks[key] = found
        return found


_BLOCKS_MAX = 64  # layouts remembered per mapping (a few per put, the same put after put)


def cached_padded(
    handles: Sequence[Handle], cache: MappingCache, seen: dict[str, Mapped] | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The padded batch of one put's equal-length 1-D rows, read in order through `cache` —
    the common case, in as few operations as Python allows; None for any other case.

    `seen`: segments this call already looked up, by name (a read of several fields of one
    put looks its segment up once; the lookup is what makes a freed handle fail)."""
    single = single_run(handles) if handles else None
    if single is None:
        return None
    run, lens = single
    count, width = len(lens), lens[0]
    if lens.count(width) != count:
        return None
    dtype_name = handles[0].dtype
    dtype = DTYPES[dtype_name]
    entry = seen.get(run.segment) if seen is not None else None
    if entry is None:
        entry = cache.lookup(run.segment)
        if seen is not None:
            seen[run.segment] = entry
    batch = entry.block(dtype, run.offset // ITEMSIZE[dtype_name], count, width).clone()
    return batch, _lengths(count, width)


# Lengths tensors by (count, width), copied for each caller (cheaper than making one afresh).
_LENGTHS: dict[tuple[int, int], torch.Tensor] = {}
_LENGTHS_MAX = 256


def _lengths(count: int, width: int) -> torch.Tensor:
    """A new int64 tensor of `count` times `width`."""
    template = _LENGTHS.get((count, width))
    if template is None:
        if len(_LENGTHS) >= _LENGTHS_MAX:
            _LENGTHS.clear()
        template = _LENGTHS[count, width] = torch.full((count,), width, dtype=torch.int64)
    return template.clone()


def map_runs(runs: Sequence[Run], cache: MappingCache | None = None) -> list[torch.Tensor]:
    """uint8 views of `runs`: through `cache`, or through fresh copy-on-write mappings (one
    per segment, kept alive by the views)."""
    if len(runs) == 1 and cache is not None:  # the common case, without the bookkeeping
        (only,) = runs
        whole = cache.data(only.segment)
        if only.offset + only.nbytes > whole.numel():
            raise ValueError(f"range {only.offset}+{only.nbytes} outside {only.segment!r}")
        return [whole[only.offset : only.offset + only.nbytes]]
    data: dict[str, torch.Tensor] = {}
    out = []
    for run in runs:
        seg = data.get(run.segment)
        if seg is None:
            if cache is not None:
                seg = cache.data(run.segment)
            else:
                try:
                    mapping = shm.map_private(run.segment)
                except FileNotFoundError:
                    raise UnknownSegment(f"segment {run.segment!r} does not exist") from None
                seg = torch.frombuffer(mapping, dtype=torch.uint8)
            data[run.segment] = seg
        if run.offset + run.nbytes > seg.numel():
            raise ValueError(f"range {run.offset}+{run.nbytes} outside segment {run.segment!r}")
        out.append(seg[run.offset : run.offset + run.nbytes])
    return out


def views_from_runs(
    handles: Sequence[Handle], runs: Sequence[Run], buffers: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Per-row tensors viewing `buffers` (uint8, one per run): no copy."""
    out: list[torch.Tensor | None] = [None] * len(handles)
    for run, buf in zip(runs, buffers, strict=True):
        rows = handles[run.start : run.stop]
        typed = buf.view(DTYPES[rows[0].dtype])
        parts = torch.split(typed, [math.prod(h.shape) for h in rows])
        for k, (h, part) in enumerate(zip(rows, parts, strict=True), run.start):
            out[k] = part if len(h.shape) == 1 else part.view(h.shape)
    return [
        t if t is not None else torch.empty(h.shape, dtype=DTYPES[h.dtype])
        for t, h in zip(out, handles, strict=True)
    ]


def _uniform(handles: Sequence[Handle]) -> tuple[str, tuple[int, ...] | None]:
    """The common (dtype, shape after dim 0) of the rows; None for rows of shape ()."""
    kinds = {(h.dtype, h.shape[1:] if h.shape else None) for h in handles}
    if len(kinds) != 1:
        raise ValueError("get_padded needs rows of one dtype and one shape after dim 0")
    return kinds.pop()


def padded_from_runs(
    handles: Sequence[Handle],
    runs: Sequence[Run],
    buffers: Sequence[torch.Tensor],
    pad: float | int | bool = 0,
    lens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ``[B, max_len, ...]`` batch padded with `pad`, and the lengths ``[B]`` (int64).

    One copy: a run of equal-length rows is one block copy, a run of varying lengths one masked
    scatter. Rows of shape ``()`` give a ``[B]`` batch and lengths of ones. `lens`: the row
    lengths, when the caller knows the rows are 1-D of one dtype (`single_run`).
    """
    count = len(handles)
    if count == 0:
        return torch.empty(0, 0), torch.empty(0, dtype=torch.int64)
    if lens is not None and len(runs) == 1 and lens.count(lens[0]) == count:
        # The common case: one put's rows, all of one length: one block copy.
        dtype = DTYPES[handles[0].dtype]
        batch = buffers[0].view(dtype).view(count, lens[0]).clone()
        return batch, torch.full((count,), lens[0], dtype=torch.int64)
    trail: tuple[int, ...] | None
    if lens is not None:
        dtype_name, trail = handles[0].dtype, ()
    else:
        dtype_name, trail = _uniform(handles)
    dtype = DTYPES[dtype_name]
    if trail is None:
        if sum(r.stop - r.start for r in runs) != count:
            raise ValueError("rows of shape () cannot be empty")
        batch = torch.empty(count, dtype=dtype)
        for run, buf in zip(runs, buffers, strict=True):
            batch[run.start : run.stop].copy_(buf.view(dtype))
        return batch, torch.ones(count, dtype=torch.int64)
    if lens is None:
        lens = [h.shape[0] for h in handles]
    width = max(lens)
    if lens.count(width) == count:
        lengths = torch.full((count,), width, dtype=torch.int64)
        if len(runs) == 1:  # one put's rows, all of one length: one block copy
            return buffers[0].view(dtype).view(count, width, *trail).clone(), lengths
    else:
        lengths = torch.tensor(lens, dtype=torch.int64)
    batch = torch.empty((count, width, *trail), dtype=dtype)
    filled = 0  # rows before this index are written
    for run, buf in zip(runs, buffers, strict=True):
        if filled < run.start:
            batch[filled : run.start].fill_(pad)
        lo, hi = run.start, run.stop
        flat = buf.view(dtype)
        first = lens[lo]
        if lens[lo:hi].count(first) == hi - lo:
            batch[lo:hi, :first].copy_(flat.view(hi - lo, first, *trail))
            if first < width:
                batch[lo:hi, first:].fill_(pad)
        else:
            block = batch[lo:hi]
            mask = torch.arange(width) < lengths[lo:hi, None]
            block.fill_(pad)
            block.masked_scatter_(mask.view(*mask.shape, *([1] * len(trail))), flat)
        filled = hi
    if filled < count:
        batch[filled:].fill_(pad)
    return batch, lengths


def local_get(handles: Sequence[Handle]) -> list[torch.Tensor]:
    """Per-row views of this node's shared memory (no copy; copy-on-write mappings)."""
    runs = contiguous_runs(handles)
    return views_from_runs(handles, runs, map_runs(runs))


def local_get_padded(
    handles: Sequence[Handle], pad: float | int | bool = 0, *, cache: MappingCache | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded batch from this node's shared memory (one copy), mapping through `cache`."""
    if cache is not None:
        fast = cached_padded(handles, cache)
        if fast is not None:
            return fast
    single = single_run(handles) if handles else None
    if single is not None:
        run, lens = single
        return padded_from_runs(handles, [run], map_runs([run], cache), pad, lens)
    runs = contiguous_runs(handles)
    return padded_from_runs(handles, runs, map_runs(runs, cache), pad)
