"""Random malformed messages for the fuzzer (`bench/fuzz.py`): RPC requests and the values,
tensor headers and blobs they are made of."""

from __future__ import annotations

import math
import random
from typing import Any, Final

import msgpack

from transport.codec import encode

_EXT_TENSOR: Final = 1
_INT_EDGES: Final = (-1, 0, 1, -(2**63), 2**63 - 1, 2**64 - 1, 2**31, -(2**31) - 1)
_FLOAT_EDGES: Final = (math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324)


class Gen:
    """Random malformed messages (seeded: a run is reproducible).

    `templates` maps each operation to a request payload that is harmless when it does reach
    its handler (ids that name nothing); `harmless` lists the operations whose template may be
    sent unmutated (under a bad request id the server must refuse it before any handler).
    """

    def __init__(self, seed: int, templates: dict[str, Any], harmless: set[str]) -> None:
        self.rng = random.Random(seed)
        self.templates = templates
        self.harmless = harmless
        self.ops = sorted(templates)

    # -- values

    def text(self, n: int | None = None) -> str:
        r = self.rng
        n = r.choice((0, 1, 8, 64, 4096)) if n is None else n
        alphabet = "abc/\\.\0\n\"'%{}é\u202e\U0001f600"
        return "".join(r.choice(alphabet) for _ in range(n))

    def blob(self, n: int | None = None) -> bytes:
        r = self.rng
        n = r.choice((0, 1, 7, 64, 300, 4096)) if n is None else n
        return r.randbytes(n)

    def tensor_ext(self) -> msgpack.ExtType:
        """A tensor header: a bad one, or one declaring terabytes."""
        r = self.rng
        kind = r.choice((0, 1, 2, -1, "torch"))
        dtype = r.choice(("float32", "bfloat16", "complex64", "", 7, None))
        shape = r.choice(([1 << 40, 1 << 20], [2**62], [-1], [3, "4"], [1] * 40, "big", [],
                          [0, 1 << 62]))
        frame = r.choice((1, 0, -1, 2, 99, "1", None))
        desc: Any = [kind, dtype, shape, frame]
        if r.random() < 0.2:
            desc = desc[: r.randrange(4)]
        data = msgpack.packb(desc) if r.random() < 0.9 else self.blob(9)
        return msgpack.ExtType(r.choice((_EXT_TENSOR, _EXT_TENSOR, 0, 2, 127)), data)

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        pick = r.randrange(11 if depth < 3 else 8)
        if pick == 0:
            return None
        if pick == 1:
            return r.choice((True, False))
        if pick == 2:
            return r.choice(_INT_EDGES) if r.random() < 0.5 else r.randrange(-1000, 1000)
        if pick == 3:
            return r.choice(_FLOAT_EDGES) if r.random() < 0.5 else r.uniform(-1e6, 1e6)
        if pick == 4:
            return self.text()
        if pick == 5:
            return self.blob()
        if pick == 6:
            return self.tensor_ext()
        if pick == 7:
            return msgpack.ExtType(r.randrange(128), self.blob(r.randrange(20)))
        if pick == 8:
            return [self.value(depth + 1) for _ in range(r.randrange(6))]
        if pick == 9:
            return {self.key(): self.value(depth + 1) for _ in range(r.randrange(6))}
        return {self.value(3): self.value(depth + 1) for _ in range(r.randrange(3))}

    def key(self) -> Any:
        r = self.rng
        if r.random() < 0.8:
            return r.choice(("worker_id", "task_id", "pid", "size", "x", "", "handles"))
        return self.value(3)

    def bad(self, good: Any) -> Any:
        """A value that is invalid where `good` is expected: another type, or out of range."""
        r = self.rng
        if type(good) is int and r.random() < 0.5:
            return r.choice((-1, -(2**63), 2**64 - 1, -7, 0, True))
        if type(good) is float and r.random() < 0.5:
            return r.choice((math.nan, math.inf, -math.inf, -1.0, 1e308))
        if isinstance(good, list) and good and r.random() < 0.5:
            return [self.bad(good[0]), *good[1:]]
        if isinstance(good, dict) and good and r.random() < 0.5:
            return self.mutate(good)
        while True:
            v = self.value(1)
            if type(v) is not type(good) and not (type(good) is float and type(v) is int):
                return v

    def mutate(self, template: Any) -> Any:
        """`template` with one field made invalid, one removed, or a junk one added."""
        r = self.rng
        if not isinstance(template, dict) or not template:
            return self.bad(template)
        out = dict(template)
        key = r.choice(sorted(out))
        action = r.random()
        if action < 0.8:
            out[key] = self.bad(out[key])
        elif action < 0.9:
            del out[key]
        else:
            out[key] = self.bad(out[key])
            out[self.text(8)] = self.value(1)
        return out

    # -- requests

    def rid(self) -> int:
        return self.rng.randrange(1 << 20)

    def bad_rid(self) -> Any:
        r = self.rng
        return r.choice(("1", 1.0, None, True, [1], {"id": 1}, b"\x01", self.tensor_ext()))

    def request(self) -> tuple[str, list[bytes]]:
        """One malformed request (the frames after the routing identity) and its kind."""
        r = self.rng
        kind = r.choice(("random", "truncated", "wrong_types", "wrong_types", "huge",
                         "unknown_op", "bad_id", "frames", "envelope"))
        op = r.choice(self.ops)
        tpl = self.templates[op]
        if kind == "random":
            frames = [self.blob() for _ in range(r.choice((1, 1, 1, 2, 5)))]
        elif kind == "truncated":
            whole = packed(encode([self.rid(), op, {"t": _small_tensor(), "p": tpl}]))
            frames = [whole[0][: r.randrange(max(1, len(whole[0])))], *whole[1:]]
            if r.random() < 0.5 and len(frames) > 1:
                frames[1] = frames[1][: r.randrange(len(frames[1]))]
        elif kind == "wrong_types":
            payload = self.mutate(tpl) if r.random() < 0.8 else self.value()
            frames = [msgpack.packb([self.rid(), op, payload], use_bin_type=True)]
        elif kind == "huge":
            payload = self.mutate(tpl) if isinstance(tpl, dict) else {}
            payload = dict(payload) if isinstance(payload, dict) else {}
            payload[r.choice(sorted(payload) or ["x"])] = self.tensor_ext()
            frames = [msgpack.packb([self.rid(), op, payload], use_bin_type=True), b"\0" * 64]
            if r.random() < 0.3:  # a msgpack container that declares billions of items
                frames = [b"\x93" + msgpack.packb(self.rid()) + b"\xdd\xff\xff\xff\xff"]
        elif kind == "unknown_op":
            name = r.choice((self.text(), "", "__init__", "_handlers", op.upper(), op + "\0",
                             self.value(1)))
            frames = [msgpack.packb([self.rid(), name, tpl], use_bin_type=True)]
        elif kind == "bad_id":
            payload = tpl if op in self.harmless else self.mutate(tpl)
            frames = [msgpack.packb([self.bad_rid(), op, payload], use_bin_type=True)]
        elif kind == "frames":
            good = packed(encode([self.rid(), op, {"t": _small_tensor(), "p": self.mutate(tpl)}]))
            if r.random() < 0.5:
                frames = [good[0]]  # the tensor's frame is missing
            else:
                frames = [*good, *(self.blob(16) for _ in range(r.randrange(1, 4)))]
        else:  # envelope: not [id, op, payload]
            frames = [msgpack.packb(r.choice((
                [self.rid(), op], [self.rid(), op, tpl, 1], {"op": op}, op, self.rid(), [],
                [[self.rid()], op, tpl])), use_bin_type=True)]
        return kind, frames


def _small_tensor() -> Any:
    import torch

    return torch.arange(8, dtype=torch.float32)


def packed(frames: list[bytes | memoryview]) -> list[bytes]:
    return [bytes(f) for f in frames]
