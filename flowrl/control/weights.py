"""Published weight versions: the handles of each version's tensors in the store, kept while
any rollout worker may still load or serve that version.

A version is kept while it is the latest or some rollout worker still serves a version at or
before it (a worker that has not switched yet may still read it); older ones are released and
their memory freed. Pure: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from transport.handles import Handle

__all__ = ["WeightVersions"]

#: name -> (handle on the wire, shape): what a trainer publishes for one version
Weights = dict[str, Any]


class WeightVersions:
    def __init__(self) -> None:
        self._by_version: dict[int, Weights] = {}

    def publish(self, version: int, weights: Weights) -> None:
        self._by_version[version] = weights

    def get(self, version: int) -> Weights | None:
        return self._by_version.get(version)

    def oldest(self) -> int | None:
        """The oldest version kept (None: none)."""
        return min(self._by_version, default=None)

    def nbytes(self, version: int) -> int | None:
        """The bytes of ``version``'s tensors (None when it was not published)."""
        weights = self._by_version.get(version)
        if not weights:
            return None
        return sum(Handle.from_wire(h).nbytes for h, _shape in weights.values()) or None

    def release(self, served: Iterable[int], current: int) -> list[Any]:
        """Forget the versions no rollout worker can need any more (none serves one at or
        before them and they are not ``current``); returns their handles, to free."""
        keep_from = min([*served, current])
        freed: list[Any] = []
        for v in [v for v in self._by_version if v < keep_from and v != current]:
            freed.extend(h for h, _shape in self._by_version.pop(v).values())
        return freed
