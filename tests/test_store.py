"""SampleStore: real shared memory, real child processes."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transport import handles as handles_mod
from transport import packing, shm
from transport.errors import ClosedError, MalformedMessage, UnknownSegment
from transport.handles import Rows, Run, rows_from_wire, single_run
from transport.reading import MappingCache, cached_padded
from transport.store import DTYPES, Handle, SampleStore, local_get, local_get_padded

pytestmark = pytest.mark.timeout(60)

NODE = "node0"


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = f"t{uuid.uuid4().hex[:10]}"
    yield rid
    leftovers = shm.list_segments(f"flowrl-{rid}-")
    for name in leftovers:
        shm.unlink(name)
    assert leftovers == [], "segments left behind"
    assert not shm.run_dir_path(rid).exists(), "run directory left behind"


@pytest.fixture
def store(run_id: str) -> Iterator[SampleStore]:
    with SampleStore(run_id, NODE, capacity_bytes=64 << 20) as s:
        yield s


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def _all(handles: dict[str, list[Handle]]) -> list[Handle]:
    return [h for hs in handles.values() for h in hs]


def _padded_reference(
    rows: list[torch.Tensor], pad: float | int | bool
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[0] for r in rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), pad, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out, torch.tensor([r.shape[0] for r in rows])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
async def test_round_trip_every_dtype(store: SampleStore, dtype: torch.dtype) -> None:
    rows = [_sample(dtype, (n,), seed=n) for n in (7, 0, 1, 33, 5)]
    handles = await store.put({"x": rows})
    assert [h.dtype for h in handles["x"]] == [handles_mod.dtype_name(dtype)] * 5
    for got, want in zip(store.get(handles["x"]), rows, strict=True):
        assert got.dtype == dtype
        assert torch.equal(got, want)
    batch, lengths = store.get_padded(handles["x"], pad=0)
    want_batch, want_lengths = _padded_reference(rows, 0)
    assert torch.equal(batch, want_batch)
    assert torch.equal(lengths, want_lengths)
    store.free(handles["x"])


async def test_round_trip_field_forms(store: SampleStore) -> None:
    """Lists of rows, (padded, lengths) pairs, batch tensors, scalars and 2-D rows, in one put."""
    rows = [torch.arange(n, dtype=torch.int64) for n in (3, 0, 9, 1)]
    padded = _sample(torch.float32, (4, 6), seed=1).requires_grad_()  # stored as plain values
    lengths = torch.tensor([6, 2, 0, 5])
    scores = torch.tensor([0.5, -1.0, 2.0, 3.5])
    grid = [_sample(torch.float16, (n, 3), seed=n).requires_grad_() for n in (2, 4, 1, 2)]
    handles = await store.put(
        {"rows": rows, "pair": (padded, lengths), "score": scores, "grid": grid}
    )
    assert {k: len(v) for k, v in handles.items()} == {"rows": 4, "pair": 4, "score": 4, "grid": 4}
    # One segment for the whole micro-batch; a zero-byte row references none.
    assert len({h.segment for h in _all(handles)} - {""}) == 1
    assert handles["rows"][1].segment == ""
    assert handles["pair"][2].segment == ""

    for got, want in zip(store.get(handles["rows"]), rows, strict=True):
        assert torch.equal(got, want)
    padded = padded.detach()
    pair_rows = [padded[i, : int(n)] for i, n in enumerate(lengths)]
    for got, want in zip(store.get(handles["pair"]), pair_rows, strict=True):
        assert torch.equal(got, want)
    assert [t.item() for t in store.get(handles["score"])] == scores.tolist()
    grid = [g.detach() for g in grid]
    for got, want in zip(store.get(handles["grid"]), grid, strict=True):
        assert torch.equal(got, want)
        assert not got.requires_grad

    batch, got_lengths = store.get_padded(handles["pair"], pad=-7.0)
    want_batch, want_lengths = _padded_reference(pair_rows, -7.0)
    assert torch.equal(batch, want_batch)
    assert torch.equal(got_lengths, want_lengths)
    batch, _ = store.get_padded(handles["grid"], pad=0)
    assert torch.equal(batch, _padded_reference(grid, 0)[0])
    scalars, ones = store.get_padded(handles["score"])
    assert torch.equal(scalars, scores)
    assert ones.tolist() == [1, 1, 1, 1]
    store.free(_all(handles))


async def test_get_is_zero_copy_and_get_padded_copies_once(store: SampleStore) -> None:
    rows = [torch.arange(16, dtype=torch.int32) + i for i in range(4)]
    handles = (await store.put({"x": rows}))["x"]
    first, second = store.get(handles), store.get(handles)
    assert [t.data_ptr() for t in first] == [t.data_ptr() for t in second]
    # The rows of one field are packed back to back in one buffer.
    ptrs = [t.data_ptr() for t in first]
    assert [b - a for a, b in itertools.pairwise(ptrs)] == [64, 64, 64]
    batch, _ = store.get_padded(handles)
    assert batch.data_ptr() not in ptrs
    batch.fill_(0)  # the copy is the caller's own
    assert torch.equal(store.get(handles)[2], rows[2])
    store.free(handles)


async def test_get_padded_across_runs_and_orders(store: SampleStore) -> None:
    a = [_sample(torch.int64, (n,), seed=n) for n in (5, 5, 5, 5)]
    b = [_sample(torch.int64, (n,), seed=10 + n) for n in (2, 9, 0, 4)]
    ha = (await store.put({"x": a}))["x"]
    hb = (await store.put({"x": b}))["x"]
    cases = [
        (ha + hb, a + b),
        (hb[::-1] + ha[1:3], b[::-1] + a[1:3]),
        ([hb[2], ha[0], hb[2]], [b[2], a[0], b[2]]),
        (ha[::2], a[::2]),
    ]
    for handles, rows in cases:
        batch, lengths = store.get_padded(handles, pad=-1)
        want_batch, want_lengths = _padded_reference(rows, -1)
        assert torch.equal(batch, want_batch)
        assert torch.equal(lengths, want_lengths)
    assert len(handles_mod.contiguous_runs(ha + hb)) == 2
    assert len(handles_mod.contiguous_runs(hb)) == 1  # the empty row does not break the run
    store.free(ha + hb)


async def test_get_padded_rejects_mixed_rows(store: SampleStore) -> None:
    handles = await store.put(
        {"a": [torch.zeros(3)], "b": [torch.zeros(3, dtype=torch.int64)], "c": [torch.zeros(2, 2)]}
    )
    with pytest.raises(ValueError, match="one dtype"):
        store.get_padded(handles["a"] + handles["b"])
    with pytest.raises(ValueError, match="one dtype"):
        store.get_padded(handles["a"] + handles["c"])
    store.free(_all(handles))


def test_handle_wire_round_trip_and_validation() -> None:
    h = Handle("n", "flowrl-run1-10-20-10-3", 64, "float32", (4, 2))
    wire = msgpack.unpackb(msgpack.packb(h))
    assert wire == ["n", "flowrl-run1-10-20-10-3", 64, "float32", [4, 2]]
    assert Handle.from_wire(wire) == h
    assert Handle.from_wire(["n", "", 0, "int8", [0]]).nbytes == 0
    bad = [
        None,
        ["n", "flowrl-run1-10-20-10-3", 64, "float32"],
        ["n", "flowrl-run1-10-20-10-3", 64, "complex64", [4]],
        ["n", "flowrl-run1-10-20-10-3", 2, "float32", [4]],  # misaligned
        ["n", "flowrl-run1-10-20-10-3", -8, "float32", [4]],
        ["n", "flowrl-run1-10-20-10-3", 8, "float32", [-1]],
        ["n", "flowrl-run1-10-20-10-3", 8, "float32", [True]],
        ["n", "../../etc/passwd", 0, "uint8", [4]],
        ["n", "flowrl-run1-10-20-10-3.tmp", 0, "uint8", [4]],
        [1, "flowrl-run1-10-20-10-3", 0, "uint8", [4]],
    ]
    for value in bad:
        with pytest.raises(MalformedMessage):
            Handle.from_wire(value)


async def test_free_retires_segments_and_rejects_misuse(run_id: str) -> None:
    with SampleStore(run_id, NODE, capacity_bytes=8 << 20, pool_bytes=0) as store:
        handles = (await store.put({"x": [torch.ones(100), torch.ones(50), torch.ones(0)]}))["x"]
        (segment,) = {h.segment for h in handles} - {""}
        assert segment in shm.list_segments(store.prefix)
        with pytest.raises(ValueError, match="node"):
            store.free([handles[0]._replace(node="other")])
        assert segment in shm.list_segments(store.prefix)
        # The handle is freed once, and the duplicate reported.
        with pytest.raises(ValueError, match="twice"):
            store.free([handles[0], handles[0], handles[2]])
        with pytest.raises(ValueError, match="twice"):
            store.free([handles[0]])
        assert segment in shm.list_segments(store.prefix)  # one handle left
        assert torch.equal(store.get(handles[1:2])[0], torch.ones(50))
        store.free([handles[1]])
        assert shm.list_segments(store.prefix) == []
        assert store.used_bytes == 0
        with pytest.raises(UnknownSegment):
            store.get(handles[:1])
        with pytest.raises(UnknownSegment):
            store.free(handles[:1])
        store.free(handles[2:])  # zero-byte rows hold nothing: freeing them is a no-op
        # A bad handle in a batch does not keep the good ones from being freed.
        other = (await store.put({"y": [torch.ones(3)]}))["y"]
        with pytest.raises(UnknownSegment):
            store.free(handles[:1] + other)
        assert not store.holds(other[0].segment)
        assert store.used_bytes == 0


async def test_freed_segments_are_pooled_and_reused(run_id: str) -> None:
    with SampleStore(run_id, NODE, capacity_bytes=8 << 20, pool_bytes=1 << 20) as store:
        first = (await store.put({"x": torch.ones(8, 1000)}))["x"]
        store.free(first)
        stats = store.statistics()
        assert stats.segments == 0
        assert stats.pooled_bytes == stats.used_bytes > 0
        (pooled,) = shm.list_segments(store.prefix)
        assert pooled.endswith(".pool")
        second = (await store.put({"x": torch.full((8, 990), 2.0)}))["x"]
        assert store.statistics().pooled_bytes == 0  # the pooled segment was rewritten
        assert all(torch.equal(t, torch.full((990,), 2.0)) for t in store.get(second))
        (published,) = shm.list_segments(store.prefix)
        assert published == second[0].segment != first[0].segment
        store.free(second)


async def test_put_waits_while_full_until_a_free(run_id: str) -> None:
    row = torch.zeros(1 << 18, dtype=torch.uint8)  # 256 KiB
    with SampleStore(run_id, NODE, capacity_bytes=3 << 18, pool_bytes=0) as store:
        h1 = (await store.put({"x": [row, row]}))["x"]
        h2 = (await store.put({"x": [row]}))["x"]
        assert store.used_bytes == store.capacity_bytes
        blocked = asyncio.create_task(store.put({"x": [row, row]}))
        try:
            await store.wait_waiting_puts(1)
            assert not blocked.done()
            store.free(h2)  # 256 KiB back: not enough for the waiting put
            assert store.statistics().waiting_puts == 1
            assert not blocked.done()
            store.free(h1)
            h3 = (await blocked)["x"]
        finally:
            blocked.cancel()
        assert store.used_bytes == 2 << 18
        store.free(h3)
        with pytest.raises(ValueError, match="exceeds the capacity"):
            await store.put({"x": [torch.zeros(1 << 20, dtype=torch.uint8)]})


async def test_waiting_puts_are_served_in_order_and_cancel_cleanly(run_id: str) -> None:
    row = torch.zeros(1 << 16, dtype=torch.uint8)
    with SampleStore(run_id, NODE, capacity_bytes=2 << 16, pool_bytes=0) as store:
        held = (await store.put({"x": [row, row]}))["x"]
        order: list[str] = []

        async def put(tag: str) -> list[Handle]:
            out = (await store.put({"x": [row]}))["x"]
            order.append(tag)
            return out

        first = asyncio.create_task(put("first"))
        await store.wait_waiting_puts(1)
        cancelled = asyncio.create_task(put("cancelled"))
        await store.wait_waiting_puts(2)
        last = asyncio.create_task(put("last"))
        await store.wait_waiting_puts(3)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        store.free(held)
        got = await first + await last
        assert order == ["first", "last"]
        store.free(got)
        assert store.used_bytes == 0


async def test_close_fails_waiting_puts_and_removes_everything(run_id: str) -> None:
    store = SampleStore(run_id, NODE, capacity_bytes=1 << 16)
    await store.put({"x": [torch.zeros(1 << 16, dtype=torch.uint8)]})
    blocked = asyncio.create_task(store.put({"x": [torch.zeros(10)]}))
    await store.wait_waiting_puts(1)
    stray = shm.create(f"{store.prefix}{os.getpid() + 1}-0.tmp", shm.PAGE)  # a writer's
    store.close()
    with pytest.raises(ClosedError):
        await blocked
    assert shm.list_segments(store.prefix) == []
    stray.close()
    with pytest.raises(ClosedError):
        await store.put({"x": [torch.zeros(1)]})


async def test_a_failed_write_publishes_nothing(
    store: SampleStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = 0
    real = packing.write_field

    def failing(plan: packing.FieldPlan, segment: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("disk on fire")
        real(plan, segment)

    monkeypatch.setattr(packing, "write_field", failing)
    with pytest.raises(RuntimeError, match="on fire"):
        await store.put({"a": [torch.ones(10)], "b": [torch.ones(10)]})
    assert shm.list_segments(store.prefix) == []
    assert store.used_bytes == 0


_READER = """
import json, sys
import torch
from transport.reading import MappingCache
from transport.store import Handle, local_get, local_get_padded
handles = [Handle.from_wire(h) for h in json.load(sys.stdin)]
cache = MappingCache()
views = local_get(handles)
batch, lengths = local_get_padded(handles, pad=-1, cache=cache)
for v in views:
    v.fill_(123)  # copy-on-write: must not reach the writer's memory, nor the cache
maps = open("/proc/self/maps").read()
print(json.dumps({
    "rows": [v.tolist() for v in local_get(handles)],
    "cached": local_get_padded(handles, pad=-1, cache=cache)[0].tolist(),
    "batch": batch.tolist(),
    "lengths": lengths.tolist(),
    "mapped": sorted({h.segment for h in handles if h.segment and h.segment in maps}),
}))
"""


async def test_another_process_reads_without_copies(store: SampleStore) -> None:
    rows = [torch.arange(n, dtype=torch.int64) * 3 for n in (4, 0, 7, 2)]
    handles = (await store.put({"x": rows}))["x"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _READER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(json.dumps(handles).encode()), 30)
    assert proc.returncode == 0
    got = json.loads(out)
    assert got["rows"] == [r.tolist() for r in rows]
    want_batch, want_lengths = _padded_reference(rows, -1)
    assert got["batch"] == want_batch.tolist()
    assert got["cached"] == want_batch.tolist()
    assert got["lengths"] == want_lengths.tolist()
    assert got["mapped"] == [handles[0].segment]
    assert [r.tolist() for r in store.get(handles)] == [r.tolist() for r in rows]
    store.free(handles)
    with pytest.raises(UnknownSegment):
        local_get(handles)
    with pytest.raises(UnknownSegment):
        local_get_padded(handles)


_KILLED_WRITER = """
import asyncio, sys
import torch
from transport import shm
from transport.store import SampleStore

async def main():
    store = SampleStore(sys.argv[1], "node0", capacity_bytes=1 << 24)
    await store.put({"x": [torch.ones(1000), torch.ones(10)]})
    shm.create(store.prefix + "1-0.tmp", shm.PAGE)  # a half-written segment
    print(store.prefix, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _killed_writer(run_id: str) -> str:
    """A store's process killed after writing two segments; its segments' prefix."""
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, run_id], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            prefix = proc.stdout.readline().strip()
            assert prefix.startswith(f"flowrl-{run_id}-{proc.pid}-")
            assert len(shm.list_segments(prefix)) == 2
            assert shm.run_dir_path(run_id).is_dir()
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
    return prefix


def test_killed_store_is_swept_by_the_next_one(run_id: str) -> None:
    # Every store that starts on this machine sweeps dead owners' segments, so a store of a
    # test running beside this one (pytest-xdist) may sweep the killed writer's first; then
    # the writer runs again, a few times at most.
    for _ in range(3):
        prefix = _killed_writer(run_id)
        left = shm.list_segments(prefix)
        if len(left) == 2:
            break
    assert len(left) == 2  # nobody cleaned up after the killed owner
    with SampleStore(run_id, "node0", capacity_bytes=1 << 20) as store:
        assert set(store.swept) >= {f"/dev/shm/{n}" for n in left} | {str(shm.run_dir_path(run_id))}
        assert shm.list_segments(prefix) == []


async def test_run_ids_with_dashes_never_touch_each_other(run_id: str) -> None:
    with SampleStore(run_id, NODE, capacity_bytes=1 << 20) as first:
        # This run id makes every segment name of `other` start with `first.prefix`.
        other_run = f"{run_id}-{first.owner.pid}-{first.owner.start}"
        other = SampleStore(other_run, NODE, capacity_bytes=1 << 20)
        try:
            theirs = (await other.put({"x": [torch.ones(3)]}))["x"]
            assert theirs[0].segment.startswith(first.prefix)
            mine = (await first.put({"x": [torch.ones(3)]}))["x"]
            assert shm.segments_of(run_id) == [mine[0].segment]
            first.close()
            assert torch.equal(other.get(theirs)[0], torch.ones(3))
            assert shm.list_segments(first.prefix) == [theirs[0].segment]
            other.free(theirs)
        finally:
            other.close()
    assert shm.segments_of(other_run) == []


async def test_readers_map_a_recycled_segment_once(run_id: str) -> None:
    cache = MappingCache()
    with SampleStore(run_id, NODE, capacity_bytes=8 << 20) as store:
        first = (await store.put({"x": torch.full((4, 1000), 1.0)}))["x"]
        batch, _ = cached_padded(first, cache) or (None, None)
        assert batch is not None
        assert torch.equal(batch, torch.full((4, 1000), 1.0))
        whole = cache.data(first[0].segment)
        store.free(first)
        with pytest.raises(UnknownSegment):
            cache.data(first[0].segment)  # the name is gone with the free
        second = (await store.put({"x": torch.full((4, 1000), 2.0)}))["x"]
        assert second[0].segment != first[0].segment
        # Same file under a new name: the cached mapping is found again, new bytes and all.
        assert cache.data(second[0].segment).data_ptr() == whole.data_ptr()
        batch, lengths = cached_padded(second, cache) or (None, None)
        assert batch is not None
        assert torch.equal(batch, torch.full((4, 1000), 2.0))
        assert lengths is not None
        assert lengths.tolist() == [1000] * 4
        # Only equal-length rows of one put, in order, take this path.
        assert cached_padded(second[::-1], cache) is None
        store.free(second)


async def test_mapping_cache_bounds_what_it_pins(store: SampleStore) -> None:
    cache = MappingCache(max_bytes=1)
    puts = [(await store.put({"x": [torch.ones(10)]}))["x"] for _ in range(3)]
    views = [cache.data(h[0].segment) for h in puts]
    # The newest only; the evicted ones live on in their views.
    assert cache.mapped_bytes == views[-1].numel()
    assert all(torch.equal(v[:40].view(torch.float32), torch.ones(10)) for v in views)
    store.free([h for hs in puts for h in hs])


# -- Rows: handles whose layout is checked once --------------------------------------------------

_SEG = "flowrl-run1-10-20-10-3"


def _field_wire(count: int, width: int, dtype: str = "int64", start: int = 64) -> list[list[Any]]:
    """The wire form of one put's field of `count` rows of `width` elements."""
    return _put_wire([width] * count, dtype, start)


def _put_wire(widths: list[int], dtype: str = "int64", start: int = 64) -> list[list[Any]]:
    """The wire form of one put's field of rows of these widths, back to back."""
    wire, offset = [], start
    for width in widths:
        wire.append(["n", _SEG, offset, dtype, [width]])
        offset += width * handles_mod.ITEMSIZE[dtype]
    return wire


def test_rows_from_wire_checks_one_field_once() -> None:
    wire = json.loads(json.dumps(_field_wire(6, 4)))
    rows = rows_from_wire(wire)
    assert isinstance(rows, Rows)
    assert rows == tuple(Handle.from_wire(w) for w in wire)
    assert all(type(h) is Handle and type(h.shape) is tuple for h in rows)
    assert rows.run == Run(0, 6, "n", _SEG, 64, 6 * 32)
    assert rows.lens == (4,) * 6
    assert single_run(rows) == (rows.run, rows.lens)
    # Rows read back in another order or mixed are still rows, checked row by row.
    assert rows_from_wire(list(reversed(wire))).run is None
    # Values equal to valid ones are taken as those values, in their exact types.
    wire[3][2], wire[4][4] = float(wire[3][2]), [4.0]
    assert rows_from_wire(wire) == rows
    assert all(type(h.offset) is int and type(h.shape[0]) is int for h in rows_from_wire(wire))
    varying = [["n", _SEG, 0, "int32", [3]], ["n", _SEG, 12, "int32", [5]]]
    assert rows_from_wire(varying).run == Run(0, 2, "n", _SEG, 0, 32)
    assert rows_from_wire(varying).lens == (3, 5)
    # Rows of several widths, back to back, are checked column by column too.
    assert all(type(h.shape) is tuple for h in rows_from_wire(varying))
    assert rows_from_wire(_put_wire([3, 1, 4, 1, 5])).lens == (3, 1, 4, 1, 5)
    assert rows_from_wire(_put_wire([3, 1, 4, 1, 5])).run == Run(0, 5, "n", _SEG, 64, 14 * 8)
    assert rows_from_wire([]).run is None
    assert rows_from_wire(rows) is rows


def test_rows_cannot_change_and_their_slices_are_checked_again() -> None:
    rows = rows_from_wire(_field_wire(4, 2))
    with pytest.raises(AttributeError):
        rows.run = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del rows.lens
    assert type(rows[::-1]) is tuple
    assert type(rows + rows) is tuple
    assert single_run(rows[::-1]) is None
    assert single_run(rows[1:3]) == (Run(0, 2, "n", _SEG, 80, 32), (2, 2))
    assert Rows(list(rows)).run == rows.run  # made from handles: checked once, then and there
    assert msgpack.unpackb(msgpack.packb(rows)) == _field_wire(4, 2)  # travels as a list


def test_rows_from_wire_rejects_what_from_wire_rejects() -> None:
    good = _field_wire(4, 2)
    cases: list[tuple[int, Any]] = [
        (2, None),
        (2, "abcde"),
        (2, good[2][:4]),
        (2, [*good[2], 0]),
        (1, ["n", _SEG, 64 + 16, "complex64", [2]]),
        (3, ["n", f"{_SEG}.tmp", 64 + 48, "int64", [2]]),
        (3, ["n", _SEG, 64 + 48, "int64", [-2]]),
        (3, ["n", _SEG, 64 + 47, "int64", [2]]),
        (0, [1, _SEG, 64, "int64", [2]]),
    ]
    for row, bad in cases:
        wire: list[Any] = [list(w) for w in good]
        wire[row] = bad
        with pytest.raises(MalformedMessage):
            rows_from_wire(wire)
    with pytest.raises(MalformedMessage):
        rows_from_wire({"not": "a list"})


_MUTATIONS = st.sampled_from(
    ["none", "swap", "node", "segment", "dtype", "shape", "offset", "misalign", "short", "drop"]
)


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(1, 6),
    width=st.integers(0, 4),
    varying=st.booleans(),
    dtype=st.sampled_from(["uint8", "int32", "float64"]),
    mutation=_MUTATIONS,
    where=st.integers(0, 5),
)
def test_rows_from_wire_agrees_with_handles_decoded_one_by_one(
    count: int, width: int, varying: bool, dtype: str, mutation: str, where: int
) -> None:
    # Varying: the widths of responses of several lengths (1 to 5 elements).
    wire = _put_wire([1 + (width + 3 * i) % 5 if varying else width for i in range(count)], dtype)
    k, itemsize = where % count, handles_mod.ITEMSIZE[dtype]
    row = wire[k]
    if mutation == "swap":
        wire[0], wire[k] = wire[k], wire[0]
    elif mutation == "node":
        row[0] = "m"
    elif mutation == "segment":
        row[1] = "flowrl-run1-10-20-10-4"
    elif mutation == "dtype":
        row[3] = "int16"
    elif mutation == "shape":
        row[4] = [width + 1] if where % 2 else [width, 1]
    elif mutation == "offset":
        row[2] += itemsize
    elif mutation == "misalign":
        row[2] += 1
    elif mutation == "short":
        del row[4]
    elif mutation == "drop":
        del wire[k]
    wire = json.loads(json.dumps(wire))
    try:
        each: tuple[Handle, ...] | None = tuple(Handle.from_wire(w) for w in wire)
    except MalformedMessage:
        each = None
    if each is None:
        with pytest.raises(MalformedMessage):
            rows_from_wire(wire)
        return
    rows = rows_from_wire(wire)
    assert rows == each
    found = single_run(list(each)) if each else None
    assert (rows.run, rows.lens) == ((None, ()) if found is None else (found[0], tuple(found[1])))


async def test_reading_freed_rows_fails_even_when_their_memory_is_reused(run_id: str) -> None:
    cache = MappingCache()
    with SampleStore(run_id, NODE, capacity_bytes=8 << 20) as store:
        first = (await store.put({"x": torch.full((4, 100), 1.0)}))["x"]
        rows = rows_from_wire(json.loads(json.dumps(first)))
        batch, _ = cached_padded(rows, cache) or (None, None)
        assert batch is not None
        assert torch.equal(batch, torch.full((4, 100), 1.0))
        store.free(first)
        second = (await store.put({"x": torch.full((4, 100), 2.0)}))["x"]
        assert second[0].offset == first[0].offset  # the same file, the same place
        with pytest.raises(UnknownSegment):
            cached_padded(rows, cache)
        with pytest.raises(UnknownSegment):
            local_get_padded(rows, cache=cache)
        with pytest.raises(UnknownSegment):
            local_get_padded(rows)
        with pytest.raises(UnknownSegment):
            store.get_padded(rows)
        batch, _ = local_get_padded(rows_from_wire(second), cache=cache)
        assert torch.equal(batch, torch.full((4, 100), 2.0))
        store.free(second)


async def test_get_padded_many_reads_every_field_as_get_padded_does(store: SampleStore) -> None:
    ids = [_sample(torch.int64, (n,), seed=n) for n in (3, 0, 5)]
    handles = await store.put(
        {"ids": ids, "logp": torch.randn(3, 7), "mask": torch.ones(3, 7, dtype=torch.bool)}
    )
    other = (await store.put({"x": torch.arange(6).view(3, 2)}))["x"]
    fields = {
        "mask": rows_from_wire(json.loads(json.dumps(handles["mask"]))),
        "ids": handles["ids"],
        "logp": handles["logp"],
        "mixed": other[::-1],
    }
    got = store.get_padded_many(fields, pad=-1)
    assert list(got) == list(fields)
    for name, hs in fields.items():
        want = store.get_padded(hs, pad=-1)
        assert torch.equal(got[name][0], want[0])
        assert torch.equal(got[name][1], want[1])
    assert store.get_padded_many({}) == {}
    store.free(_all(handles) + other)
    with pytest.raises(UnknownSegment):
        store.get_padded_many({"ids": handles["ids"]})


async def test_rows_of_one_shape_get_the_handles_the_general_layout_gives(
    store: SampleStore,
) -> None:
    fields: dict[str, packing.FieldData] = {
        "batch": torch.arange(12).view(3, 2, 2),
        "no_rows": torch.empty(0, 4),
        "rows": [torch.ones(5)] * 3,
        "full_pairs": (torch.ones(4, 3), torch.full((4,), 3)),
        "short_pairs": (torch.ones(2, 3), torch.tensor([3, 1])),
        "empty_rows": torch.empty(3, 0),
    }
    plans, _ = packing.plan_fields(fields)
    assert [p.uniform for p in plans] == [(2, 2), (4,), (5,), (3,), None, (0,)]
    shortcut = packing.make_handles("n", _SEG, plans)
    for plan in plans:
        plan.uniform = None
    assert packing.make_handles("n", _SEG, plans) == shortcut
    handles = await store.put(fields)
    assert torch.equal(store.get_padded(handles["batch"])[0], torch.arange(12).view(3, 2, 2))
    assert store.get_padded(handles["no_rows"])[0].numel() == 0
    assert torch.equal(store.get_padded(handles["full_pairs"])[0], torch.ones(4, 3))
    batch, lengths = store.get_padded(handles["short_pairs"], pad=-1)
    assert batch.tolist() == [[1, 1, 1], [1, -1, -1]]
    assert lengths.tolist() == [3, 1]
    store.free(_all(handles))


async def test_padded_reads_are_the_callers_own_and_stay_inside_the_segment(run_id: str) -> None:
    cache = MappingCache()
    with SampleStore(run_id, NODE, capacity_bytes=8 << 20) as store:
        handles = (await store.put({"x": torch.full((4, 100), 3.0)}))["x"]
        rows = rows_from_wire(json.loads(json.dumps(handles)))
        for _ in range(2):  # the second read reuses what the first one set up
            batch, lengths = local_get_padded(rows, cache=cache)
            assert torch.equal(batch, torch.full((4, 100), 3.0))
            assert lengths.tolist() == [100] * 4
            batch.fill_(0)
            lengths.fill_(0)
        size = shm.size_of(handles[0].segment)
        beyond = [h._replace(offset=size - 400 + 400 * i) for i, h in enumerate(handles)]
        for crafted in (beyond, rows_from_wire([list(h) for h in beyond])):
            with pytest.raises(ValueError, match="outside"):
                local_get_padded(crafted, cache=cache)
        assert torch.equal(store.get(handles)[0], torch.full((100,), 3.0))
        store.free(handles)


async def test_whole_batches_are_copied_as_bytes_and_others_as_tensors(store: SampleStore) -> None:
    base = torch.arange(24, dtype=torch.int32).view(4, 6)
    fields: dict[str, packing.FieldData] = {
        "whole": base,
        "transposed": base.t(),  # not contiguous: copied by torch
        "half": base.to(torch.bfloat16),
        "bools": base % 2 == 0,
    }
    handles = await store.put(fields)
    for name, want in fields.items():
        assert isinstance(want, torch.Tensor)
        assert torch.equal(store.get_padded(handles[name])[0], want), name
    store.free(_all(handles))
    segment = torch.zeros(16, dtype=torch.uint8)
    packing._copy_bytes(segment, 8, torch.full((2,), -1, dtype=torch.int32), 8)
    assert segment.tolist() == [0] * 8 + [255] * 8
    for offset, src in [(9, torch.zeros(2, dtype=torch.int32)), (-1, torch.zeros(1))]:
        with pytest.raises(ValueError, match="do not fit"):
            packing._copy_bytes(segment, offset, src, src.numel() * src.element_size())
    with pytest.raises(ValueError, match="do not fit"):
        packing._copy_bytes(segment, 0, torch.zeros(2, dtype=torch.int32), 4)
