"""Admission: which dataset positions enter the run, and for which train step.

Groups are admitted in order; group k is meant for train step ``gate.step_of(k)``. A group is
admitted only while the staleness gate allows its step (`flowrl.staleness`) and the sample
store has room for it (`flowrl.backpressure`). Positions given back (a group dropped as stale,
or in flight when the checkpoint being resumed was taken) are admitted again before new ones.

Pure: no sockets, no clock (callers pass ``now``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from flowrl.backpressure import StoreBackpressure
from flowrl.resume import RunState
from flowrl.staleness import StalenessGate

__all__ = ["Admission"]


class Admission:
    """Admitted groups: their dataset positions and the steps they are meant for."""

    def __init__(self, gate: StalenessGate, store: StoreBackpressure, *,
                 on_store_pause: Callable[[bool], None] | None = None,
                 on_store_refused: Callable[[], None] | None = None) -> None:
        """``on_store_pause(paused)``: admission started (True) or stopped (False) waiting
        for the store; ``on_store_refused()``: a group waits for the store (fresh store
        accounting may let it in)."""
        self.gate = gate
        self.store = store
        self._on_store_pause = on_store_pause
        self._on_store_refused = on_store_refused
        #: groups admitted so far (the next group's admission index)
        self.admitted = 0
        #: the next dataset position never admitted before
        self.next_position = 0
        self._redo: collections.deque[int] = collections.deque()
        self._step: dict[int, int] = {}  # group id -> the step it is meant for
        self._position: dict[int, int] = {}  # group id -> its dataset position

    def resume(self, state: RunState) -> None:
        """Continue after ``state``'s version: positions it had in flight go first."""
        self.admitted = state.version * self.gate.groups_per_step
        self._redo.extend(state.redo())
        self.next_position = state.admitted_to

    # ---- decisions -------------------------------------------------------------------------

    @property
    def next_step(self) -> int:
        """The step the next admitted group is meant for."""
        return self.gate.step_of(self.admitted)

    def open(self, version: int) -> bool:
        """Whether the staleness gate admits the next group while the trainer is at ``version``."""
        return self.gate.can_admit(self.admitted, version)

    def store_admits(self, version: int, now: float) -> bool:
        """Whether the store has room for one more group (always for the next step's)."""
        was = self.store.paused
        ok = self.store.admits(self.untrained(version), now)
        if self._on_store_pause is not None and self.store.paused != was:
            self._on_store_pause(self.store.paused)
        if not ok and self._on_store_refused is not None:
            self._on_store_refused()
        return ok

    def untrained(self, version: int) -> int:
        """Groups admitted for steps not yet committed (their data is or will be in the store)."""
        return self.admitted - version * self.gate.groups_per_step

    def min_generation_version(self, step: int) -> int:
        return self.gate.min_generation_version(step)

    # ---- changes ---------------------------------------------------------------------------

    def admit(self, gid: int) -> int:
        """Group ``gid`` is admitted for `next_step`; returns the dataset position it samples."""
        if self._redo:
            pos = self._redo.popleft()
        else:
            pos, self.next_position = self.next_position, self.next_position + 1
        self._step[gid] = self.next_step
        self._position[gid] = pos
        self.admitted += 1
        return pos

    def take_position(self) -> int:
        """The position the next admitted group will sample (`admit` takes it)."""
        return self._redo[0] if self._redo else self.next_position

    def step_of(self, gid: int) -> int:
        return self._step[gid]

    def dropped(self, gid: int) -> None:
        """Group ``gid`` was dropped as stale: its prompt is sampled again, in its slot."""
        self._step.pop(gid, None)
        self._redo.appendleft(self._position.pop(gid))
        self.admitted -= 1

    def trained(self, gid: int) -> int | None:
        """Group ``gid`` was trained; returns its dataset position (None if unknown)."""
        self._step.pop(gid, None)
        return self._position.pop(gid, None)
