"""Codec: round trips over every dtype and shape, zero-copy on both ends, hostile input."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transport._zsocket import new_socket
from transport.codec import DTYPES, MAX_MESSAGE_BYTES, RUN_EXT, decode, encode, frames_nbytes
from transport.errors import MalformedMessage, MessageTooLarge
from transport.handles import (
    Handle,
    free_entries,
    freed_handles,
    handle_node,
    handle_nodes,
    is_handle,
    rows_from_wire,
    run_rows,
    run_to_wire,
    to_wire,
)

pytestmark = pytest.mark.timeout(60)

TORCH_DTYPES = [d.torch for d in DTYPES.values()]
NUMPY_DTYPES = [d.numpy for d in DTYPES.values() if d.numpy is not None]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3), (2, 1, 4)]


def _torch_sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _numpy_sample(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values: np.ndarray[Any, Any]
    if dtype == np.bool_:
        values = rng.integers(0, 2, shape)
    elif dtype.kind == "f":
        values = rng.standard_normal(shape) * 100
    else:
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, shape, dtype=np.int64)
    return np.asarray(values).astype(dtype)  # 0-d stays an array, not a numpy scalar


def assert_same(a: Any, b: Any) -> None:
    """Structural equality: tensors by kind, dtype, shape and bits; tuples come back as lists."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert torch.equal(a.detach(), b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert type(a) is type(b)
        assert a == b


@pytest.fixture
def socket_pair(zmq_ctx: zmq.asyncio.Context) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    """Two connected blocking PAIR sockets over tcp loopback, for real received frames."""
    a = new_socket(zmq_ctx, zmq.PAIR)
    b = new_socket(zmq_ctx, zmq.PAIR)
    b.setsockopt(zmq.RCVTIMEO, 10_000)  # a lost frame fails the test instead of hanging it
    a.bind("tcp://127.0.0.1:0")
    b.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))
    yield a, b
    a.close()
    b.close()


def _roundtrip_zmq(pair: tuple[zmq.Socket[Any], zmq.Socket[Any]], obj: Any) -> Any:
    a, b = pair
    a.send_multipart(encode(obj), copy=False)
    return decode(b.recv_multipart(copy=False))


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_roundtrip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _torch_sample(dtype, shape)
    out = decode(encode({"t": t}))["t"]
    assert_same(t, out)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_roundtrip_every_dtype_and_shape(
    dtype: np.dtype[Any], shape: tuple[int, ...]
) -> None:
    a = _numpy_sample(dtype, shape)
    out = decode(encode([a]))[0]
    assert_same(a, out)


def test_roundtrip_through_real_sockets_all_dtypes(
    socket_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    # Sizes on both sides of libzmq's 8 KiB receive batch: small frames arrive unaligned.
    payload = {
        "torch": [_torch_sample(d, (n,), seed=n) for d in TORCH_DTYPES for n in (5, 3000)],
        "numpy": [_numpy_sample(d, (n,), seed=n) for d in NUMPY_DTYPES for n in (5, 3000)],
    }
    out = _roundtrip_zmq(socket_pair, payload)
    assert_same(payload, out)
    for t in out["torch"]:
        assert t.data_ptr() % t.element_size() == 0


def test_plain_values_pass_through_and_tuples_become_lists() -> None:
    obj = {
        "i": -(2**63),
        "u": 2**64 - 1,
        "f": 1.5,
        "s": "héllo",
        "b": b"\x00\xff",
        "n": None,
        "t": True,
        "tup": (1, (2, 3)),
        7: "int keys are allowed",
    }
    out = decode(encode(obj))
    assert out == {**obj, "tup": [1, [2, 3]]}


def test_numpy_scalars_travel_as_numbers() -> None:
    assert decode(encode([np.float32(2.5), np.int64(-3), np.bool_(True)])) == [2.5, -3, True]


def test_unsupported_values_raise_type_error() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="object"):
        encode(np.array([object()]))
    with pytest.raises(TypeError, match="set"):
        encode({1, 2})
    with pytest.raises(TypeError):
        encode(np.zeros(2, dtype=">f4"))  # byte-swapped: refused, never silently reinterpreted


def test_non_contiguous_and_grad_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = [base.t(), base[:, ::2], base[1:3, 1:5], base.expand(2, 4, 6)[1]]
    w = torch.ones(3, requires_grad=True)
    out = decode(encode([*views, w, np.arange(12).reshape(3, 4).T]))
    for v, o in zip(views, out, strict=False):
        assert torch.equal(v, o)
        assert o.is_contiguous()
    assert torch.equal(out[4], w.detach())
    assert not out[4].requires_grad
    assert np.array_equal(out[5], np.arange(12).reshape(3, 4).T)


# -- zero copy -----------------------------------------------------------------------------


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def test_encode_does_not_copy_tensor_memory() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    a = np.arange(1000, dtype=np.float64)
    frames = encode({"t": t, "a": a})
    assert len(frames) == 3
    assert _address(frames[1]) == t.data_ptr()
    assert _address(frames[2]) == a.ctypes.data
    assert frames_nbytes(frames) == len(frames[0]) + t.nbytes + a.nbytes


def test_decode_builds_tensors_over_received_frames(
    socket_pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    a, b = socket_pair
    t = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB: zero-copy on both ends
    a.send_multipart(encode([t, t.numpy()]), copy=False)
    frames = b.recv_multipart(copy=False)
    out_t, out_a = decode(frames)
    assert out_t.data_ptr() == _address(frames[1].buffer)
    assert out_a.ctypes.data == _address(frames[2].buffer)
    assert out_a.flags.writeable
    out_t[0] = 42.0  # writes land in the received frame: it is the tensor's memory
    assert np.frombuffer(frames[1].buffer, dtype=np.float32)[0] == 42.0
    del frames  # the tensors keep their frames alive
    assert out_t[1].item() == 1.0
    assert out_a[-1] == (1 << 16) - 1


def test_decode_views_writable_buffers_and_copies_read_only_ones() -> None:
    t = torch.arange(64, dtype=torch.int64)
    frames = encode(t)
    writable = [frames[0], memoryview(bytearray(frames[1]))]
    assert decode(writable).data_ptr() == _address(writable[1])
    copied = decode([bytes(f) for f in frames])
    assert torch.equal(copied, t)
    copied += 1  # a copy owns writable memory
    assert torch.equal(copied, t + 1)


def test_misaligned_frames_are_copied_to_aligned_memory() -> None:
    t = torch.arange(10, dtype=torch.float64)
    header, body = encode(t)
    shifted = memoryview(bytearray(1 + len(body)))[1:]
    shifted[:] = body
    out = decode([header, shifted])
    assert out.data_ptr() % 8 == 0
    assert torch.equal(out, t)


# -- hostile input -------------------------------------------------------------------------


def _desc(kind: Any, dtype: Any, shape: Any, index: Any) -> bytes:
    packed: bytes = msgpack.packb(msgpack.ExtType(1, msgpack.packb([kind, dtype, shape, index])))
    return packed


MALFORMED: dict[str, list[Any]] = {
    "no frames": [],
    "random bytes": [b"\xc1\x00\xff"],
    "empty frame": [b""],
    "truncated header": [encode({"a": [1, 2, 3]})[0][:-2]],
    "trailing bytes": [bytes(encode(1)[0]) + b"\x01"],
    "short frame": [_desc(0, "float32", [4], 1), b"\x00" * 15],
    "long frame": [_desc(0, "float32", [4], 1), b"\x00" * 17],
    "missing frame": [_desc(0, "float32", [4], 1)],
    "unreferenced frame": [encode(1)[0], b"\x00" * 4],
    "frame zero": [_desc(0, "uint8", [1], 0), b"\x00"],
    "reused frame": [
        msgpack.packb([msgpack.ExtType(1, msgpack.packb([0, "uint8", [1], 1]))] * 2),
        b"\x00",
    ],
    "unknown dtype": [_desc(0, "complex64", [1], 1), b"\x00" * 8],
    "numpy bfloat16": [_desc(1, "bfloat16", [1], 1), b"\x00" * 2],
    "unknown kind": [_desc(2, "uint8", [1], 1), b"\x00"],
    "bool kind": [_desc(True, "uint8", [1], 1), b"\x00"],
    "negative dim": [_desc(0, "uint8", [-1], 1), b""],
    "float dim": [_desc(0, "uint8", [1.0], 1), b"\x00"],
    "shape not a list": [_desc(0, "uint8", 1, 1), b"\x00"],
    "too many dims": [_desc(0, "uint8", [1] * 33, 1), b"\x00"],
    "descriptor not a list": [msgpack.packb(msgpack.ExtType(1, msgpack.packb("x"))), b""],
    "descriptor garbage": [msgpack.packb(msgpack.ExtType(1, b"\xc1")), b""],
    "unknown ext type": [msgpack.packb(msgpack.ExtType(9, b"")), b""],
    "unhashable key": [b"\x81\x91\x01\x02"],
    "deep nesting": [b"\x91" * 100_000 + b"\x01"],
    "huge array header": [b"\xdd\xff\xff\xff\xff"],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_input_raises_malformed_message(frames: list[Any]) -> None:
    with pytest.raises(MalformedMessage):
        decode(frames)


def test_an_endpoint_taking_no_tensors_refuses_a_message_holding_one() -> None:
    for value in (torch.zeros(2), np.zeros(2, dtype=np.float32), torch.empty(0)):
        frames = encode({"op": "x", "nested": [{"t": value}]})
        assert decode(frames)["op"] == "x"  # the default takes them
        with pytest.raises(MalformedMessage, match="takes none"):
            decode(frames, tensors=False)
    assert decode(encode({"op": "x", "n": [1.5]}), tensors=False) == {"op": "x", "n": [1.5]}


def test_size_limits() -> None:
    frames = encode(torch.zeros(1000, dtype=torch.uint8))
    assert decode(frames, max_bytes=frames_nbytes(frames)).shape == (1000,)
    with pytest.raises(MessageTooLarge):
        decode(frames, max_bytes=frames_nbytes(frames) - 1)
    # A header may declare far more than arrived: refused on the declaration alone.
    huge = [_desc(0, "float64", [1 << 40, 1 << 40], 1), b""]
    with pytest.raises(MessageTooLarge):
        decode(huge)
    assert MAX_MESSAGE_BYTES >= 1 << 30


# -- property tests ------------------------------------------------------------------------

_dims = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    shape = draw(_dims)
    seed = draw(st.integers(0, 2**16))
    if draw(st.booleans()):
        t = _torch_sample(draw(st.sampled_from(TORCH_DTYPES)), shape, seed)
        if t.dim() >= 2 and draw(st.booleans()):
            t = t.transpose(0, 1)  # non-contiguous
        elif t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
            t = t[::2]
        return t
    a = _numpy_sample(draw(st.sampled_from(NUMPY_DTYPES)), shape, seed)
    if a.ndim >= 2 and draw(st.booleans()):
        a = a.T
    return a


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | tensors()
)
payloads = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.mark.timeout(150)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_roundtrip_property(obj: Any) -> None:
    assert_same(obj, decode(encode(obj)))


_frame = st.binary(max_size=64)


@settings(max_examples=500, deadline=None)
@given(st.lists(_frame, max_size=4))
def test_fuzz_random_frames_raise_only_malformed(frames: list[bytes]) -> None:
    with contextlib.suppress(MalformedMessage):
        decode(frames, max_bytes=1 << 20)


@settings(max_examples=500, deadline=None)
@given(payloads, st.data())
def test_fuzz_mutated_messages_raise_only_malformed(obj: Any, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in encode(obj)]
    i = data.draw(st.integers(0, len(frames) - 1))
    target = frames[i]
    action = data.draw(st.sampled_from(["flip", "truncate", "drop", "append"]))
    if action == "flip" and target:
        pos = data.draw(st.integers(0, len(target) - 1))
        target[pos] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del target[data.draw(st.integers(0, len(target))) :]
    elif action == "drop":
        del frames[i]
    else:
        frames.append(bytearray(data.draw(_frame)))
    with contextlib.suppress(MalformedMessage):
        decode([memoryview(f) for f in frames], max_bytes=1 << 20)


# ---- handles in field values ---------------------------------------------------------------------

_SEG = "flowrl-run1-10-20-10-3"


def _handles(count: int) -> list[Handle]:
    return [Handle("n", _SEG, 64 + 32 * i, "int64", (4,)) for i in range(count)]


def test_a_handle_is_told_from_an_inline_value_by_type() -> None:
    hs = _handles(3)
    span = [0, 4, 8, 12, 16]  # an inline value of a handle's length
    out = decode(encode({"tokens": to_wire(hs), "span": [span], "reward": [1.0]}))
    assert [is_handle(v) for v in out["tokens"]] == [True] * 3
    assert not is_handle(out["span"][0])
    assert out["span"] == [span]
    assert not is_handle(out["reward"][0])
    assert not is_handle(list(hs[0]))
    assert not is_handle(hs[0])
    assert [Handle.from_wire(v) for v in out["tokens"]] == hs
    rows = rows_from_wire(out["tokens"])
    assert list(rows) == hs
    assert rows.run is not None
    # Sent on again (the controller passes a report's handles on to a task), it is the same.
    again = decode(encode({"inputs": out["tokens"]}))["inputs"]
    assert again == out["tokens"]
    assert all(map(is_handle, again))


@pytest.mark.parametrize("bad", [
    msgpack.ExtType(2, b"\xc1"),  # not msgpack
    msgpack.ExtType(2, msgpack.packb([1, 2, 3])),  # not a handle's fields
    msgpack.ExtType(2, msgpack.packb(["n", "nope", 0, "int64", [1]])),  # bad segment
    msgpack.ExtType(3, msgpack.packb(["n", _SEG, 0, "int64", [1]])),  # not the handle type
])
def test_a_malformed_handle_is_a_malformed_message(bad: msgpack.ExtType) -> None:
    with pytest.raises(MalformedMessage):
        Handle.from_wire(bad)
    with pytest.raises(MalformedMessage):
        rows_from_wire([bad])
    with pytest.raises(MalformedMessage):
        rows_from_wire([*to_wire(_handles(2)), bad])


# ---- a field's rows of one put as one run ------------------------------------------------------


def test_a_run_is_its_rows_wherever_a_handle_is_taken() -> None:
    hs = _handles(4)
    run = decode(encode({"f": run_to_wire(hs)}))["f"]  # as a worker reports it
    rows = run_rows(run)  # as the controller keeps it: (run, i) a row
    assert [Handle.from_wire(r) for r in rows] == hs
    assert all(map(is_handle, rows))
    assert handle_nodes(rows) == ["n"] * 4
    assert handle_node(rows[2]) == "n"
    sent = decode(encode({"inputs": rows}))["inputs"]  # as a reader gets them: lists
    assert all(map(is_handle, sent))
    assert handle_nodes(sent) == ["n"] * 4
    whole = rows_from_wire(sent)
    assert list(whole) == hs
    assert whole.run is not None
    assert (whole.run.offset, whole.run.nbytes) == (64, 4 * 32)
    middle = rows_from_wire(sent[1:3])
    assert list(middle) == hs[1:3]
    assert middle.run is not None
    assert (middle.run.offset, middle.lens) == (96, (4, 4))
    # Out of order, or mixed with handles of their own: the rows all the same.
    assert list(rows_from_wire([sent[3], sent[0]])) == [hs[3], hs[0]]
    mixed = rows_from_wire([*to_wire(_handles(5)[4:]), *sent[:2]])
    assert list(mixed) == [_handles(5)[4], *hs[:2]]
    assert not is_handle([run, 0, 1])
    assert not is_handle([1, 0])


def test_only_one_puts_one_dimensional_rows_make_a_run() -> None:
    hs = _handles(3)
    assert run_to_wire(hs[:1]) is None  # one row: a handle is as short
    assert run_to_wire([hs[0], hs[2]]) is None  # not back to back
    assert run_to_wire([*hs[:2], hs[2]._replace(segment="flowrl-run1-10-20-10-4")]) is None
    assert run_to_wire([Handle("n", _SEG, 64 * i, "int64", (2, 4)) for i in range(2)]) is None
    assert run_to_wire([Handle("n", _SEG, 64, "int64", (0,)), hs[0]]) is None
    widths = [Handle("n", _SEG, 64, "int64", (4,)), Handle("n", _SEG, 96, "int64", (2,))]
    assert [Handle.from_wire(r) for r in run_rows(run_to_wire(widths))] == widths


def _bad_run(fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(RUN_EXT, msgpack.packb(fields))


@pytest.mark.parametrize("bad", [
    msgpack.ExtType(RUN_EXT, b"\xc1"),  # not msgpack
    _bad_run(["n", _SEG, 64, "int64"]),  # not a run's fields
    _bad_run(["n", _SEG, 64, "int64", []]),  # no rows
    _bad_run(["n", _SEG, 64, "int64", [4, 0]]),  # an empty row
    _bad_run(["n", _SEG, 64, "int64", [4, True]]),  # not a length
    _bad_run(["n", _SEG, 64, "int64", 4]),
    _bad_run(["n", "nope", 64, "int64", [4]]),  # bad segment
    _bad_run(["n", "", 64, "int64", [4]]),  # names no segment
    _bad_run(["n", _SEG, 63, "int64", [4]]),  # misaligned
    _bad_run(["n", _SEG, -8, "int64", [4]]),
    _bad_run(["n", _SEG, 64, "complex", [4]]),
    _bad_run([1, _SEG, 64, "int64", [4]]),
    msgpack.ExtType(2, msgpack.packb(["n", _SEG, 64, "int64", [4]])),  # a handle, not a run
])
def test_a_malformed_run_is_a_malformed_message(bad: msgpack.ExtType) -> None:
    with pytest.raises(MalformedMessage):
        run_rows(bad)
    with pytest.raises(MalformedMessage):
        Handle.from_wire([bad, 0])
    with pytest.raises(MalformedMessage):
        rows_from_wire([[bad, 0], [bad, 1]])


@pytest.mark.parametrize("row", [-1, 2, "0", 1.0, True, None])
def test_a_row_outside_its_run_is_a_malformed_message(row: Any) -> None:
    run = run_to_wire(_handles(2))
    with pytest.raises(MalformedMessage):
        Handle.from_wire([run, row])
    with pytest.raises(MalformedMessage):
        rows_from_wire([[run, row], [run, 0]])
    if row in (1.0, True):  # equal to a valid row: taken as it, as `rows_from_wire` says
        assert list(rows_from_wire([[run, 0], [run, row]])) == _handles(2)
    else:
        with pytest.raises(MalformedMessage):
            rows_from_wire([[run, 0], [run, row]])


# ---- frees: a run's rows as one entry -----------------------------------------------------------


def test_frees_name_a_runs_rows_once_and_leave_inline_values_out() -> None:
    first, second = run_to_wire(_handles(4)), run_to_wire(_handles(6)[4:])
    assert first is not None
    assert second is not None
    lone = to_wire(_handles(8)[7:])[0]
    rows = run_rows(first)
    # As the index retires them: a group's rows with its rewards, groups of runs interleaved.
    retired = [*rows[:2], 0.5, run_rows(second)[1], lone, *rows[2:], 7, None, [1, 2, 3]]
    entries = free_entries(retired)
    assert entries == [[first, [0, 1, 2, 3]], [second, [1]], lone]
    sent = decode(encode({"handles": entries}))["handles"]  # as the store gets them
    assert freed_handles(sent) == [*_handles(4), _handles(6)[5], _handles(8)[7]]
    # Equal runs that are different objects (decoded apart) are one entry too.
    again = decode(encode({"rows": run_rows(first)}))["rows"]
    assert free_entries([*again[:1], *run_rows(first)[1:2]]) == [[first, [0, 1]]]
    # Row pairs as `Handle.from_wire` takes them, and plain handles, still free as before.
    assert freed_handles([[first, 3], list(_handles(1)[0])]) == [_handles(4)[3], _handles(1)[0]]
    assert free_entries([]) == []
    assert freed_handles([]) == []


@pytest.mark.parametrize("bad", [
    "nope",
    [[run_to_wire(_handles(2)), [0, 2]]],  # a row outside its run
    [[run_to_wire(_handles(2)), [0, "1"]]],
    [[run_to_wire(_handles(2)), [True]]],
    [[msgpack.ExtType(RUN_EXT, b"\xc1"), [0]]],  # not a run
    [[to_wire(_handles(1))[0], [0]]],  # a handle is not a run
    [[run_to_wire(_handles(2)), [0]], ["n", "nope", 0, "int64", [4]]],  # one bad handle
])
def test_a_malformed_free_names_nothing_to_free(bad: Any) -> None:
    with pytest.raises(MalformedMessage):
        freed_handles(bad)
