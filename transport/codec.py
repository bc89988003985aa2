"""Message codec: msgpack envelopes with tensors as out-of-band ZeroMQ frames.

Wire format. Frame 0 is msgpack. Every torch.Tensor or numpy.ndarray inside the payload is
replaced by msgpack ExtType 1 whose data is msgpack `[kind, dtype, shape, frame]` (kind 0 =
torch, 1 = numpy; dtype a name from `DTYPES`; frame the index of the extra frame holding the
raw little-endian, C-ordered bytes). A store handle in a field value travels as ExtType 2
(`HANDLE_EXT`, made by `transport.handles.handle_to_wire`), and a field's rows of one put may
travel as one ExtType 3 (`RUN_EXT`, made by `transport.handles.run_to_wire`); both decode as that
`msgpack.ExtType`, unvalidated (`transport.handles` validates them where they are used), so a
receiver tells handles from inline values by type, never by shape. No pickle: nothing on the
wire can name a Python type.

Guarantees:
- `encode` copies no tensor bytes: an extra frame is a memoryview over the tensor's own memory
  (non-contiguous tensors are made contiguous first; tensors off the CPU are copied to it).
  The frame keeps its tensor alive, but zmq may send it after `send` returns: do not write to
  a tensor that is being sent.
- `decode` builds tensors over the received frames: a `zmq.Frame` owns its message, and its
  buffer is writable, so `torch.frombuffer` wraps it directly (no copy and no non-writable
  buffer warning). Two cases copy instead, both cheap: read-only inputs (`bytes`), because torch
  tensors must own writable memory, and frames whose address is not a multiple of the item size
  (libzmq packs frames below its 8 KiB receive batch at arbitrary offsets; larger ones are
  allocated alone and aligned), because SIMD kernels may assume aligned data.
  Do not decode in-process (`inproc://`) zero-copy sends: the frames would alias the sender's
  tensors.
- `decode` raises only `MalformedMessage` or its subclass `MessageTooLarge`, whatever the input:
  random bytes, truncated or extra frames, sizes that disagree, unknown dtypes or ext types.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import msgpack
import numpy as np
import zmq

from transport.errors import MalformedMessage, MessageTooLarge

if TYPE_CHECKING:
    import torch
else:
    from transport.lazy_torch import torch

__all__ = ["DTYPES", "HANDLE_EXT", "MAX_MESSAGE_BYTES", "RUN_EXT", "decode", "encode",
           "frames_nbytes", "wire_dtype"]

MAX_MESSAGE_BYTES: Final = 1 << 30
"""Default cap on one message: the sum of its frames (and of the sizes its header declares)."""

_EXT_TENSOR: Final = 1
HANDLE_EXT: Final = 2
"""msgpack ext type of a store handle: its data is the msgpack array of the handle's fields."""
RUN_EXT: Final = 3
"""msgpack ext type of a field's rows of one put, back to back: its data is the msgpack array
``[node, segment, start, dtype, lengths]`` (`transport.handles.run_to_wire`)."""
_TORCH: Final = 0
_NUMPY: Final = 1
_MAX_NDIM: Final = 32

Frame = bytes | memoryview | zmq.Frame
_tuple_new: Final = tuple.__new__


class _DType(NamedTuple):
    name: str  # torch's own name of the dtype
    numpy: np.dtype[Any] | None  # numpy has no bfloat16
    itemsize: int

    @property
    def torch(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.name)
        return dtype


DTYPES: Final[dict[str, _DType]] = {
    d.name: d
    for d in (
        _DType("bool", np.dtype(np.bool_), 1),
        _DType("uint8", np.dtype(np.uint8), 1),
        _DType("int8", np.dtype(np.int8), 1),
        _DType("int16", np.dtype(np.int16), 2),
        _DType("int32", np.dtype(np.int32), 4),
        _DType("int64", np.dtype(np.int64), 8),
        _DType("float16", np.dtype(np.float16), 2),
        _DType("bfloat16", None, 2),
        _DType("float32", np.dtype(np.float32), 4),
        _DType("float64", np.dtype(np.float64), 8),
    )
}
"""Every dtype the wire carries, by wire name."""

_BY_TORCH: dict[torch.dtype, _DType] = {}  # filled when the first tensor is encoded
# Keyed by dtype equality: a byte-swapped dtype is not equal to the native one, so it is refused.
_BY_NUMPY: Final = {d.numpy: d for d in DTYPES.values() if d.numpy is not None}


def wire_dtype(dtype: torch.dtype) -> _DType | None:
    """The wire dtype of a torch dtype (None: the wire does not carry it)."""
    if not _BY_TORCH:
        _BY_TORCH.update((d.torch, d) for d in DTYPES.values())
    return _BY_TORCH.get(dtype)


def _torch_frame(t: torch.Tensor) -> tuple[list[Any], memoryview | bytes]:
    dt = wire_dtype(t.dtype)
    if dt is None:
        raise TypeError(f"cannot encode a tensor of dtype {t.dtype}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    shape = list(t.shape)
    if t.numel() == 0:
        return [_TORCH, dt.name, shape, 0], b""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # a one-element tensor counts as contiguous whatever its stride
        flat = flat.as_strided((1,), (1,))
    # A uint8 view of the same memory: numpy has no bfloat16, and a byte view is all zmq needs.
    return [_TORCH, dt.name, shape, 0], flat.view(torch.uint8).numpy().data


def _numpy_frame(a: np.ndarray[Any, Any]) -> tuple[list[Any], memoryview | bytes]:
    dt = _BY_NUMPY.get(a.dtype)
    if dt is None:
        raise TypeError(f"cannot encode an array of dtype {a.dtype}")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    shape = list(a.shape)
    if a.size == 0:
        return [_NUMPY, dt.name, shape, 0], b""
    return [_NUMPY, dt.name, shape, 0], a.reshape(-1).view(np.uint8).data


def encode(obj: Any) -> list[bytes | memoryview]:
    """Encode `obj` into frames: msgpack in frame 0, one extra frame per tensor or array.

    Raises TypeError for values msgpack cannot carry (and for unsupported dtypes).
    """
    frames: list[bytes | memoryview] = [b""]

    def default(value: Any) -> Any:
        # A process that never imported torch holds no tensor (and need not import it here).
        torch_module = sys.modules.get("torch")
        if torch_module is not None and isinstance(value, torch_module.Tensor):
            desc, buf = _torch_frame(value)
        elif isinstance(value, np.ndarray):
            desc, buf = _numpy_frame(value)
        elif isinstance(value, np.generic):
            return value.item()  # numpy scalars travel as plain numbers
        else:
            raise TypeError(f"cannot encode a value of type {type(value).__name__}")
        desc[3] = len(frames)
        frames.append(buf)
        return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(desc))

    frames[0] = msgpack.packb(obj, default=default, use_bin_type=True)
    return frames


def frames_nbytes(frames: Sequence[bytes | memoryview]) -> int:
    """Total size of encoded frames, as `decode` counts it against its limit."""
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def _byte_view(frame: Frame) -> memoryview:
    view = frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _build(kind: int, dt: _DType, shape: list[int], view: memoryview) -> Any:
    if view.nbytes == 0:
        if kind == _TORCH:
            return torch.empty(shape, dtype=dt.torch)
        assert dt.numpy is not None
        return np.empty(shape, dtype=dt.numpy)
    base = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    if base.data_ptr() % dt.itemsize:
        base = base.clone()  # torch allocations are aligned
    tensor = base.view(dt.torch).reshape(shape)
    return tensor if kind == _TORCH else tensor.numpy()


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass and is not a valid size


def _tensor_hook(
    views: list[memoryview], max_bytes: int, tensors: bool
) -> tuple[Callable[[int, bytes], Any], set[int]]:
    used: set[int] = set()

    def hook(code: int, data: bytes) -> Any:
        if code != _EXT_TENSOR:
            return _frameless_hook(code, data)  # a handle, a run, or an unknown type
        if not tensors:
            raise MalformedMessage("a tensor where this endpoint takes none")
        desc = msgpack.unpackb(data)
        if not (isinstance(desc, list) and len(desc) == 4):
            raise MalformedMessage("tensor descriptor is not [kind, dtype, shape, frame]")
        kind, name, shape, index = desc
        if kind not in (_TORCH, _NUMPY) or not _is_int(kind):
            raise MalformedMessage(f"unknown tensor kind {kind!r}")
        dt = DTYPES.get(name) if isinstance(name, str) else None
        if dt is None or (kind == _NUMPY and dt.numpy is None):
            raise MalformedMessage(f"unknown dtype {name!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= _MAX_NDIM
            and all(_is_int(n) and n >= 0 for n in shape)
        ):
            raise MalformedMessage(f"invalid shape {shape!r}")
        if not (_is_int(index) and 0 < index < len(views)) or index in used:
            raise MalformedMessage(f"invalid or reused frame index {index!r}")
        used.add(index)
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes > max_bytes:
            raise MessageTooLarge(f"tensor of {nbytes} bytes exceeds the {max_bytes}-byte limit")
        view = views[index]
        if view.nbytes != nbytes:
            raise MalformedMessage(
                f"frame {index} holds {view.nbytes} bytes, its header declares {nbytes}"
            )
        return _build(kind, dt, shape, view)

    return hook, used


class _HasTensor(Exception):
    """A tensor in a message of one frame (`_frameless_hook`)."""


def _frameless_hook(code: int, data: bytes) -> Any:
    """The ext hook of a message of one frame, made once; `_tensor_hook`'s passes it every
    ext type but a tensor."""
    if code in (HANDLE_EXT, RUN_EXT):
        # ExtType's own constructor re-checks what msgpack guarantees, in three Python
        # frames per handle; the controller decodes every row's handles.
        return _tuple_new(msgpack.ExtType, (code, data))
    if code == _EXT_TENSOR:
        raise _HasTensor
    raise MalformedMessage(f"unknown ext type {code}")


def _check_size(nbytes: int, max_bytes: int) -> None:
    if nbytes > max_bytes:
        raise MessageTooLarge(f"message of {nbytes} bytes exceeds the {max_bytes}-byte limit")


def decode(frames: Sequence[Frame], *, max_bytes: int = MAX_MESSAGE_BYTES,
           tensors: bool = True) -> Any:
    """Decode frames made by `encode`; tensors are views over the frames where possible.
    ``tensors=False``: a tensor or array in the message makes it malformed (for endpoints whose
    requests carry none, so that no hostile message makes their process load torch).

    Raises MessageTooLarge when the frames or a declared tensor exceed `max_bytes`, and
    MalformedMessage for anything else that is not a valid message.
    """
    try:
        if len(frames) == 1:  # most messages: no tensor, so none of the frames' bookkeeping
            view = _byte_view(frames[0])
            _check_size(view.nbytes, max_bytes)
            try:
                return msgpack.unpackb(view, ext_hook=_frameless_hook, strict_map_key=False)
            except _HasTensor:
                pass  # malformed (no frame for it): the full decode below says why
        views = [_byte_view(f) for f in frames]
        if not views:
            raise MalformedMessage("empty message")
        _check_size(sum(v.nbytes for v in views), max_bytes)
        hook, used = _tensor_hook(views, max_bytes, tensors)
        obj = msgpack.unpackb(views[0], ext_hook=hook, strict_map_key=False)
        if len(used) != len(views) - 1:
            raise MalformedMessage(
                f"{len(views) - 1} extra frames, {len(used)} referenced by the header"
            )
        return obj
    except MalformedMessage:
        raise
    except Exception as exc:  # whatever msgpack, numpy or torch raise on hostile input
        raise MalformedMessage(f"undecodable message: {type(exc).__name__}: {exc}") from exc
