"""Authenticated requests on a link without curve: an HMAC-SHA256 tag on every request.

For a trusted fabric where encryption costs more than the link can carry (see
`transport.store_server`'s plaintext reads): the bytes travel in clear, but only holders of
the run's keys can make a server act. A request carries one extra frame before its own,
msgpack ``[timestamp_ns, nonce, tag]``, where ``tag`` is HMAC-SHA256 under a key derived from
the run's client secret key (`RequestAuth.from_keys`) over the timestamp, the nonce and every
frame of the request (so over its operation and payload bytes), each length-prefixed.

Guarantees of `RequestAuth.verify`:
- it admits a request only when its tag is right (compared in constant time), its timestamp is
  within ``window_s`` of the verifier's clock (either way: clocks of two nodes differ), and its
  nonce was not admitted before within that window: a captured request replayed later is
  refused, which matters because store segments are reused and a replayed read would return
  newer data;
- a nonce is remembered for two windows of elapsed time (a monotonic clock: a wall clock set
  back or ahead neither forgets nor keeps it sooner or later), the longest its timestamp can
  stay within the window of a wall clock that runs true; after that the timestamp alone
  refuses it. Memory is bounded by the requests of two windows; past ``max_nonces``
  remembered, requests are refused until old ones expire. A replay after those two windows is
  refused by its timestamp unless the verifier's wall clock has been set back to it;
- only a request with a right tag is remembered: a peer without the key cannot fill the memory;
- it never raises on hostile input: every refusal is counted by reason (`statistics`).

It gives no confidentiality, and replies no integrity: anyone on the path can read requests
and replies, and alter replies.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import msgpack
from zmq.utils import z85

from transport.curve import CurveKeys

__all__ = ["AuthStats", "RequestAuth"]

_LABEL: Final = b"flowrl request authentication v1"
_NONCE_BYTES: Final = 16
_TAG_BYTES: Final = 32
# msgpack of [uint64, bin16, bin32]: 1 + 9 + 18 + 34 bytes; anything longer is not ours.
_MAX_FRAME: Final = 64
_NS: Final = 1_000_000_000

Buffer = bytes | memoryview


@dataclass(frozen=True, slots=True)
class AuthStats:
    accepted: int
    malformed: int  # no authenticator frame, or not of the expected shape
    bad_tag: int  # wrong key, or a request changed on the way
    stale: int  # timestamp outside the window
    replayed: int  # nonce already admitted within the window
    full: int  # too many nonces remembered


class RequestAuth:
    """Signs requests (client) and verifies them (server) with one shared key."""

    def __init__(
        self,
        key: bytes,
        *,
        window_s: float = 30.0,
        max_nonces: int = 1 << 20,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: wall-clock seconds, for timestamps (the two sides are on different
        machines, so a monotonic clock would not compare); `monotonic`: seconds that never go
        back, for how long nonces are remembered."""
        if len(key) < 32:
            raise ValueError("the key must have at least 32 bytes")
        if not window_s > 0:
            raise ValueError("window_s must be positive")
        self._key = key
        self._window_ns = int(window_s * _NS)
        self._max_nonces = max_nonces
        self._clock = clock
        self._monotonic = monotonic
        self._seen: set[bytes] = set()
        # heap of (monotonic admission time + two windows, nonce): admitted at wall time N, a
        # timestamp is within N ± window, so a true wall clock leaves it behind within 2 windows
        self._expiry: list[tuple[int, bytes]] = []
        self._accepted = 0
        self._malformed = 0
        self._bad_tag = 0
        self._stale = 0
        self._replayed = 0
        self._full = 0

    @classmethod
    def from_keys(
        cls, keys: CurveKeys, *, window_s: float = 30.0, clock: Callable[[], float] = time.time
    ) -> RequestAuth:
        """The authenticator of `keys`' run: its key is derived from the client secret key,
        which only the run's own processes hold, under a label of its own (the secret key is
        never used directly)."""
        key = hmac.new(z85.decode(keys.client_secret), _LABEL, hashlib.sha256).digest()
        return cls(key, window_s=window_s, clock=clock)

    def _now_ns(self) -> int:
        return int(self._clock() * _NS)

    def _tag(self, ts: int, nonce: bytes, frames: Sequence[Buffer]) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(ts.to_bytes(8, "big") + nonce + len(frames).to_bytes(4, "big"))
        for frame in frames:
            size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
            mac.update(size.to_bytes(8, "big"))
            mac.update(frame)
        return mac.digest()

    def sign(self, frames: Sequence[Buffer]) -> bytes:
        """The authenticator frame to send before `frames`."""
        ts = self._now_ns()
        nonce = secrets.token_bytes(_NONCE_BYTES)
        packed: bytes = msgpack.packb([ts, nonce, self._tag(ts, nonce, frames)])
        return packed

    def verify(self, frames: Sequence[Buffer]) -> bool:
        """Whether to serve a request received as `frames`: its authenticator frame (what
        `sign` made), then the request's own."""
        parsed = _parse(frames[0]) if len(frames) > 1 else None
        if parsed is None:
            self._malformed += 1
            return False
        ts, nonce, tag = parsed
        if not hmac.compare_digest(tag, self._tag(ts, nonce, frames[1:])):
            self._bad_tag += 1
            return False
        if abs(self._now_ns() - ts) > self._window_ns:
            self._stale += 1
            return False
        elapsed = int(self._monotonic() * _NS)
        self._expire(elapsed)
        if nonce in self._seen:
            self._replayed += 1
            return False
        if len(self._seen) >= self._max_nonces:
            self._full += 1
            return False
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (elapsed + 2 * self._window_ns, nonce))
        self._accepted += 1
        return True

    def _expire(self, elapsed: int) -> None:
        expiry, seen = self._expiry, self._seen
        while expiry and expiry[0][0] < elapsed:  # its timestamp alone refuses it from now on
            seen.discard(heapq.heappop(expiry)[1])

    def statistics(self) -> AuthStats:
        return AuthStats(
            accepted=self._accepted,
            malformed=self._malformed,
            bad_tag=self._bad_tag,
            stale=self._stale,
            replayed=self._replayed,
            full=self._full,
        )


def _parse(auth: Buffer) -> tuple[int, bytes, bytes] | None:
    if len(auth) > _MAX_FRAME:
        return None
    try:
        value = msgpack.unpackb(auth)
    except Exception:  # msgpack raises several types on bad bytes; all mean "not ours"
        return None
    if not (type(value) is list and len(value) == 3):
        return None
    ts, nonce, tag = value
    if not (type(ts) is int and type(nonce) is bytes and type(tag) is bytes):
        return None
    if len(nonce) != _NONCE_BYTES or len(tag) != _TAG_BYTES:
        return None
    return ts, nonce, tag
