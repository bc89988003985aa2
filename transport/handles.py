"""Handles: where one row of one field lives in a node's sample store.

A `Handle` is a plain tuple ``(node, segment, offset, dtype, shape)``, validated on arrival
(`Handle.from_wire`). Where a value may be a handle or an inline value (a field of a task or of
a report: rewards and prompt positions travel inline), a handle travels as msgpack ext type
`transport.codec.HANDLE_EXT` (`to_wire`), so `is_handle` tells them apart by type, never by
shape. Messages that carry nothing but handles (store reads and frees) may send them as lists.

A field's rows of one put may also travel as one value, a *run* (`run_to_wire`: msgpack ext
type `transport.codec.RUN_EXT`, ``[node, segment, start, dtype, lengths]`` of 1-D rows back to
back): a worker reports what it wrote so, and the controller checks the run once (`run_rows`)
and keeps each row as the pair ``(run, i)``, which is a handle wherever one is taken
(`is_handle`, `Handle.from_wire`, `rows_from_wire`, `handle_nodes`). So no per-row handle is
decoded, checked or built where every row of every report passes: the controller.

A store's ``free`` takes a run's rows as one entry too, ``[run, [i, ...]]`` (`free_entries`
builds them from what the controller retires, `freed_handles` checks them at the store): a
step's frees cost a few values a put, not a handle a row.

Rows of one field of one put are packed back to back, so the handles of a micro-batch read
back in order form one contiguous byte range: `contiguous_runs` finds such runs, so a read costs
one operation per run, not per row.

Finding that out costs a few C-level passes over the rows on every read. `Rows` is an immutable
sequence of handles that carries the answer, found once: `rows_from_wire` decodes a message's
handles into `Rows` (checking the rows of one field of one put column by column rather than
row by row, which also makes decoding cheaper), and reads of a `Rows` skip the check. A `Rows`
cannot change after the check, so the answer stays true; slices and concatenations of it are
plain tuples, checked again when read.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import msgpack

from transport import shm
from transport.codec import DTYPES as WIRE_DTYPES
from transport.codec import HANDLE_EXT, RUN_EXT, wire_dtype
from transport.errors import MalformedMessage

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = [
    "DTYPES",
    "ITEMSIZE",
    "Handle",
    "Rows",
    "Run",
    "contiguous_runs",
    "dtype_name",
    "free_entries",
    "freed_handles",
    "handle_node",
    "handle_nodes",
    "handle_to_wire",
    "is_handle",
    "is_run",
    "rows_from_wire",
    "run_rows",
    "run_to_wire",
    "single_run",
    "to_wire",
]

ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in WIRE_DTYPES.values()}
"""Bytes per element of every dtype the store holds, by wire name (`transport.codec.DTYPES`)."""


class _TorchDtypes(Mapping[str, "torch.dtype"]):
    """The torch dtype of each wire name, looked up on first use (without importing torch
    before a tensor is made: `transport.lazy_torch`)."""

    def __init__(self) -> None:
        self._found: dict[str, torch.dtype] = {}

    def __getitem__(self, name: str) -> torch.dtype:
        found = self._found.get(name)
        if found is None:
            found = self._found[name] = WIRE_DTYPES[name].torch
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(WIRE_DTYPES)

    def __len__(self) -> int:
        return len(WIRE_DTYPES)


DTYPES: Final = _TorchDtypes()
"""Every dtype the store holds: wire name -> torch dtype."""

_MAX_NDIM = 8


def dtype_name(dtype: torch.dtype) -> str:
    found = wire_dtype(dtype)
    if found is None:
        raise TypeError(f"unsupported dtype {dtype}")
    return found.name


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
        """Validate a decoded handle (its ext form, a list or a tuple) and return it;
        MalformedMessage if bad.

        A row of a run, the pair ``(run, i)`` (`run_rows`), is taken as the handle of that row.

        Called once per row on every decoded message: kept to type checks and dict lookups
        (segment names and runs are checked once, then remembered).
        """
        if type(value) is msgpack.ExtType:
            value = _unwrap(value)
        elif type(value) in _PAIRS and len(value) == 2:
            return _run_row(value)
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


def handle_to_wire(handle: Handle) -> msgpack.ExtType:
    """`handle` as it travels in a field value: msgpack ext type `HANDLE_EXT`."""
    return msgpack.ExtType(HANDLE_EXT, msgpack.packb(handle))


def to_wire(handles: Iterable[Handle]) -> list[msgpack.ExtType]:
    """`handle_to_wire` of each handle."""
    return [msgpack.ExtType(HANDLE_EXT, msgpack.packb(h)) for h in handles]


def is_handle(value: Any) -> bool:
    """Whether a decoded field value is a store handle (sent by `to_wire`, or a run's row
    ``(run, i)``) rather than an inline value such as a prompt position or a reward. Its
    validity is `Handle.from_wire`'s check."""
    kind = type(value)
    if kind is msgpack.ExtType:
        return bool(value.code == HANDLE_EXT)
    return kind in _PAIRS and len(value) == 2 and is_run(value[0])


def is_run(value: Any) -> bool:
    """Whether a decoded value is a run of rows (sent by `run_to_wire`); `run_rows` checks it."""
    return type(value) is msgpack.ExtType and value.code == RUN_EXT


def handle_node(value: Any) -> str | None:
    """The node whose store holds handle ``value`` (in its ext form, or a run's row); None for
    an inline value or an undecodable handle (what `Handle.from_wire` refuses holds no memory
    anywhere)."""
    if not is_handle(value):
        return None
    return _ext_node(value if type(value) is msgpack.ExtType else value[0])  # a row: its run's


def _ext_node(value: msgpack.ExtType) -> str | None:
    """The node a handle's or a run's ext form names, unvalidated; None if undecodable."""
    try:
        return _node_of(msgpack.unpackb(value.data))
    except Exception:  # whatever msgpack raises on hostile bytes
        return None


def handle_nodes(values: Sequence[Any]) -> list[str | None]:
    """The node named by each handle of ``values`` (ext forms, or lists as store frees carry
    them); None where a value is not a handle or cannot be decoded. Unvalidated: for routing a
    store operation, whose store checks each handle.

    A handle, and a run, packs as an array of 5 whose first item is its node, a short string:
    its first bytes are the node's name, so they are looked up instead of decoding every
    handle (a step's frees are a few handles a sample, most of them of a few nodes).
    """
    seen: dict[bytes, str | None] = {}  # a handle's leading bytes -> its node
    out: list[str | None] = []
    for v in values:
        if (type(v) is tuple or type(v) is list) and len(v) == 2:  # a run's row
            v = v[0]  # its run names the node
        if type(v) is msgpack.ExtType and (v.code == HANDLE_EXT or v.code == RUN_EXT):
            data = v.data
            if len(data) > 2 and data[0] == 0x95 and data[1] & 0xE0 == 0xA0:  # fixstr node
                lead = data[:2 + (data[1] & 0x1F)]
                node = seen.get(lead)
                if node is None and lead not in seen:
                    node = seen[lead] = _fixstr(lead[2:])
                out.append(node)
                continue
            out.append(_ext_node(v))
        else:
            out.append(_node_of(v))
    return out


def _fixstr(raw: bytes) -> str | None:
    """A node's name from its bytes; None if they are not UTF-8 (no store is named so)."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


def _node_of(fields: Any) -> str | None:
    """The node of a handle's decoded fields, unvalidated; None if it names none."""
    node = fields[0] if type(fields) in _SEQUENCES and fields else None
    return node if type(node) is str else None


def _unwrap_all(values: Sequence[Any]) -> list[Any]:
    """The fields of every handle of `values` (all in their ext form), decoded as one msgpack
    array in one call rather than one call per handle; MalformedMessage if undecodable. A
    handle whose bytes spill into the next one's can only misplace the sender's own handles,
    and each comes out validated by the caller all the same."""
    if not all(type(v) is msgpack.ExtType and v.code == HANDLE_EXT for v in values):
        return [_unwrap(v) if type(v) is msgpack.ExtType else v for v in values]
    n = len(values)
    header = (bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16
              else b"\xdd" + n.to_bytes(4, "big"))
    try:
        fields: list[Any] = msgpack.unpackb(header + b"".join([v.data for v in values]))
    except Exception as exc:  # whatever msgpack raises on hostile bytes
        raise MalformedMessage(f"undecodable handles: {type(exc).__name__}: {exc}") from None
    return fields


def _unwrap(value: Any) -> Any:
    """The fields of a handle in its ext form, unvalidated; MalformedMessage if undecodable."""
    if value.code != HANDLE_EXT:
        raise MalformedMessage(f"ext type {value.code} is not a handle")
    try:
        return msgpack.unpackb(value.data)
    except Exception as exc:  # whatever msgpack raises on hostile bytes
        raise MalformedMessage(f"undecodable handle: {type(exc).__name__}: {exc}") from None


class _RunRows:
    """A run's rows, checked (`_run_from_wire`): where the first starts and each row's length;
    each row's offset (and the end) is worked out when a row's handle is first asked for, which
    the controller, keeping a run's rows as ``(run, i)`` pairs, never does."""

    __slots__ = ("_bounds", "dtype", "itemsize", "lens", "node", "segment", "start")

    def __init__(self, node: str, segment: str, dtype: str, start: int, itemsize: int,
                 lens: tuple[int, ...]) -> None:
        self.node, self.segment, self.dtype = node, segment, dtype
        self.start, self.itemsize, self.lens = start, itemsize, lens
        self._bounds: tuple[int, ...] | None = None

    @property
    def bounds(self) -> tuple[int, ...]:
        if self._bounds is None:
            self._bounds = tuple(itertools.accumulate(
                [n * self.itemsize for n in self.lens], initial=self.start))
        return self._bounds


# Runs already checked, by their bytes: a run is named by every row of it that is read or freed.
_RUNS: dict[bytes, _RunRows] = {}
_RUNS_MAX = 4096
_PAIRS = {list, tuple}


def run_to_wire(handles: Sequence[Handle]) -> msgpack.ExtType | None:
    """``handles`` as one value, a run (ext type `RUN_EXT`), when they are 1-D rows of one field
    of one put, in order, and more than one; else None (send them with `to_wire`)."""
    found = single_run(handles) if len(handles) > 1 else None
    if found is None:
        return None
    run, lens = found
    return msgpack.ExtType(RUN_EXT, msgpack.packb(
        (run.node, run.segment, run.offset, handles[0].dtype, list(lens))))


def run_rows(value: Any) -> list[tuple[msgpack.ExtType, int]]:
    """The rows of a run (as `run_to_wire` sends it), checked: ``(run, i)`` for each row i,
    each a handle wherever one is taken. MalformedMessage if the run is bad."""
    return list(zip(repeat(value), range(len(_run_from_wire(value).lens))))


def _run_from_wire(value: Any) -> _RunRows:
    """A run's rows, checked as `Handle.from_wire` checks a handle (and every length a positive
    int); MalformedMessage if bad."""
    if not is_run(value):
        raise MalformedMessage(f"a run is ext type {RUN_EXT}, got {value!r:.100}")
    found = _RUNS.get(value.data)
    if found is not None:
        return found
    try:
        fields = msgpack.unpackb(value.data)
    except Exception as exc:  # whatever msgpack raises on hostile bytes
        raise MalformedMessage(f"undecodable run: {type(exc).__name__}: {exc}") from None
    if type(fields) is not list or len(fields) != 5:
        raise MalformedMessage(f"a run is [node, segment, start, dtype, lengths], got "
                               f"{fields!r:.200}")
    node, segment, start, dtype, lens = fields
    if type(lens) is not list or not lens:
        raise MalformedMessage(f"a run's lengths are a non-empty list, got {lens!r:.200}")
    first = Handle.from_wire([node, segment, start, dtype, lens[:1]])
    if not first.segment:
        raise MalformedMessage("a run names a segment")
    if set(map(type, lens)) != {int} or min(lens) <= 0:
        raise MalformedMessage(f"a run's lengths are positive integers, got {lens!r:.200}")
    if len(_RUNS) >= _RUNS_MAX:
        _RUNS.clear()
    found = _RUNS[value.data] = _RunRows(node, first.segment, dtype, start, ITEMSIZE[dtype],
                                         tuple(lens))
    return found


def _run_row(value: list[Any] | tuple[Any, ...]) -> Handle:
    """The handle of a run's row ``(run, i)``; MalformedMessage if bad."""
    ext, i = value
    return _row_handle(_run_from_wire(ext), i)


def _row_handle(run: _RunRows, i: Any) -> Handle:
    """The handle of row ``i`` of ``run`` (checked); MalformedMessage if there is no such row."""
    if type(i) is not int or not 0 <= i < len(run.lens):
        raise MalformedMessage(f"row {i!r:.50} of a run of {len(run.lens)} rows")
    return tuple.__new__(Handle, (run.node, run.segment, run.bounds[i], run.dtype,
                                  (run.lens[i],)))


def free_entries(values: Iterable[Any]) -> list[Any]:
    """The handles among ``values`` (inline values such as rewards left out) as a store's
    ``free`` takes them: a handle as it is, and the rows of one run (``(run, i)`` pairs,
    `run_rows`) as one entry ``[run, [i, ...]]``, wherever they are among ``values``.

    Rows retire a group at a time, so most of a run's rows come together: the pair's run is
    compared by identity first (`run_rows` gives every row of a report's run the same one)."""
    out: list[Any] = []
    by_run: dict[msgpack.ExtType, list[int]] = {}
    last: Any = None
    rows: list[int] = []
    for v in values:
        kind = type(v)
        if kind is tuple or kind is list:
            if len(v) != 2:
                continue
            run, i = v
            if run is not last:
                if not is_run(run):
                    continue
                found = by_run.get(run)
                if found is None:
                    found = by_run[run] = []
                    out.append([run, found])
                last, rows = run, found
            rows.append(i)
        # `is_handle` written out: every inline value (a step's rewards) passes here
        elif kind is msgpack.ExtType and v.code == HANDLE_EXT:
            out.append(v)
    return out


def freed_handles(entries: Any) -> list[Handle]:
    """The handles a store's ``free`` names, checked: each entry a handle (`Handle.from_wire`:
    its ext form, a list, or a run's row ``[run, i]``) or a run's rows ``[run, [i, ...]]``
    (`free_entries`). MalformedMessage if any is bad."""
    if type(entries) is not list:
        raise MalformedMessage("handles must be a list")
    out: list[Handle] = []
    for e in entries:
        if type(e) in _PAIRS and len(e) == 2 and type(e[1]) is list:
            run = _run_from_wire(e[0])
            out.extend(_row_handle(run, i) for i in e[1])
        else:
            out.append(Handle.from_wire(e))
    return out


class Run(NamedTuple):
    """Rows ``[start, stop)`` of a handle list whose bytes are one contiguous range."""

    start: int
    stop: int
    node: str
    segment: str
    offset: int
    nbytes: int


def single_run(handles: Sequence[Handle]) -> tuple[Run, Sequence[int]] | None:
    """(run, row lengths) when `handles` are non-empty 1-D rows of one field of one put, in
    order (the common case); otherwise None. Free for `Rows`; a few C-level passes otherwise."""
    if isinstance(handles, Rows):
        run = handles.run
        return None if run is None else (run, handles.lens)
    return _find_single_run(handles)


def _find_single_run(handles: Sequence[Handle]) -> tuple[Run, Sequence[int]] | None:
    nodes, segments, offsets, dtypes, shapes = zip(*handles, strict=False)
    count = len(offsets)
    if (
        not segments[0]
        or segments.count(segments[0]) != count
        or dtypes.count(dtypes[0]) != count
        or nodes.count(nodes[0]) != count
    ):
        return None
    start = offsets[0]
    packed = _packed(start, ITEMSIZE[dtypes[0]], shapes[0], offsets, shapes)
    if packed is None:
        return None
    lens, bounds = packed
    return Run(0, count, nodes[0], segments[0], start, bounds[-1] - start), lens


def _packed(start: int, itemsize: int, first: Sequence[int], offsets: tuple[Any, ...],
            shapes: tuple[Any, ...]) -> tuple[tuple[int, ...], Sequence[int]] | None:
    """(row lengths, bounds) when 1-D rows of ``shapes`` lie back to back from ``start`` at
    ``offsets``, none of them empty: ``bounds`` are each row's start, then the end. Else None.
    ``first`` is row 0's shape, validated; the other shapes and the offsets may be wire values
    (a number equal to a valid one counts as that one)."""
    count = len(offsets)
    if len(first) != 1:
        return None
    if shapes.count(shapes[0]) == count:  # one width: compared with a kept progression
        step = first[0] * itemsize
        if not step or offsets != _progression(start, step, count):
            return None
        return (first[0],) * count, range(start, start + step * (count + 1), step)
    if not set(map(type, shapes)) <= {list, tuple} or set(map(len, shapes)) != {1}:
        return None
    lens = tuple(itertools.chain.from_iterable(shapes))
    if set(map(type, lens)) != {int} or min(lens) <= 0:
        return None
    bounds = tuple(itertools.accumulate([n * itemsize for n in lens], initial=start))
    return (lens, bounds) if bounds[:-1] == offsets else None


# Offsets of equal rows, by (start, step, count): a micro-batch layout repeats with every put,
# so comparing against a kept tuple spares building one per read.
_PROGRESSIONS: dict[tuple[int, int, int], tuple[int, ...]] = {}
_PROGRESSIONS_MAX = 1024


def _progression(start: int, step: int, count: int) -> tuple[int, ...]:
    key = (start, step, count)
    found = _PROGRESSIONS.get(key)
    if found is None:
        if len(_PROGRESSIONS) >= _PROGRESSIONS_MAX:
            _PROGRESSIONS.clear()
        found = _PROGRESSIONS[key] = tuple(range(start, start + step * count, step))
    return found


class Rows(tuple[Handle, ...]):
    """An immutable sequence of handles whose layout was checked once, when it was made.

    ``run`` and ``lens``: what `single_run` finds for these handles (1-D rows of one field of
    one put, in order), else None and ``()``. Reads take them as they are; since neither the
    tuple nor its handles can change, they stay true. Travels on the wire as a list of handles.
    """

    run: Run | None
    lens: tuple[int, ...]

    def __new__(cls, handles: Iterable[Handle] = ()) -> Rows:
        self = super().__new__(cls, handles)
        found = _find_single_run(self) if self else None
        if found is None:
            return _settled(self, None, ())
        return _settled(self, found[0], tuple(found[1]))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Rows are immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Rows are immutable")


def _settled(rows: Rows, run: Run | None, lens: tuple[int, ...]) -> Rows:
    object.__setattr__(rows, "run", run)
    object.__setattr__(rows, "lens", lens)
    return rows


_SEQUENCES = {list, tuple, Handle}


def rows_from_wire(value: Any) -> Rows:
    """Validate a decoded list of handles (ext forms or lists), as `Handle.from_wire` does
    each, into `Rows`.

    1-D rows of one field of one put, in order — what a put returns and a reader asks for,
    of one width or of several — are checked column by column (a few C-level passes) and
    rebuilt from the first row's validated values and the checked offsets and widths (so a
    number equal to a valid one is taken as that value: an offset of 64.0 as 64); anything
    else is validated row by row. MalformedMessage if bad.
    """
    if type(value) not in (list, tuple, Rows):
        raise MalformedMessage(f"handles travel as a list, got {type(value).__name__}")
    if isinstance(value, Rows):
        return value
    if value and type(value[0]) in _PAIRS and len(value[0]) == 2:  # rows of runs
        fast = _run_slice(value)
        return fast if fast is not None else Rows(map(Handle.from_wire, value))
    if value and type(value[0]) is msgpack.ExtType:  # a field's handles, in their ext form
        value = _unwrap_all(value)
    fast = _uniform_from_wire(value) if len(value) > 1 else None
    if fast is not None:
        return fast
    return Rows(map(Handle.from_wire, value))


def _uniform_from_wire(value: list[Any] | tuple[Any, ...]) -> Rows | None:
    if not set(map(type, value)) <= _SEQUENCES:
        return None
    try:
        columns = tuple(zip(*value, strict=True))
    except ValueError:  # rows of different sizes: the slow path says which is bad
        return None
    if len(columns) != 5:
        return None
    nodes, segments, offsets, dtypes, shapes = columns
    node, segment, start, dtype, shape = Handle.from_wire(value[0])
    count = len(value)
    if (
        not segment
        or nodes.count(node) != count
        or segments.count(segment) != count
        or dtypes.count(dtype) != count
    ):
        return None
    packed = _packed(start, ITEMSIZE[dtype], shape, offsets, shapes)
    if packed is None:
        return None
    lens, bounds = packed
    # Every row equals the one validated above but for its offset and width, both checked
    # by `_packed`: build the handles from validated values (ints, strs, tuple shapes).
    return _packed_rows(node, segment, dtype, bounds, lens)


def _packed_rows(node: str, segment: str, dtype: str, bounds: Sequence[int],
                 lens: tuple[int, ...]) -> Rows:
    """`Rows` of checked 1-D rows back to back: row k at ``bounds[k]``, ``lens[k]`` long."""
    columns_out = zip(repeat(node), repeat(segment), bounds[:-1], repeat(dtype), zip(lens))
    rows = tuple.__new__(Rows, map(tuple.__new__, repeat(Handle), columns_out))
    start = bounds[0]
    return _settled(rows, Run(0, len(lens), node, segment, start, bounds[-1] - start), lens)


def _run_slice(value: list[Any] | tuple[Any, ...]) -> Rows | None:
    """`Rows` of consecutive rows of one run, in order (what a reader is sent of one put's
    rows), checked once; None for anything else."""
    ext, first = value[0]
    run = _run_from_wire(ext)
    count = len(value)
    if type(first) is not int or first < 0 or first + count > len(run.lens):
        return None
    try:
        exts, rows = zip(*value, strict=True)
    except (TypeError, ValueError):  # not all pairs: the slow path says which is bad
        return None
    if exts.count(ext) != count or rows != tuple(range(first, first + count)):
        return None
    return _packed_rows(run.node, run.segment, run.dtype, run.bounds[first:first + count + 1],
                        run.lens[first:first + count])


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
