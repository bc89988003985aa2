"""Store backpressure: when admission waits for the sample store, and when a full store is stuck.

A pure policy (no I/O, no task): the controller feeds it the store's accounting (`observe`,
the store server's ``stats``), asks it before admitting each prompt group (`admits`), and, when
nothing has happened for a while, asks it whether the run is stuck on the store (`stalled`).

Why: rows leave the store only when the optimizer step that trains them commits, and that
step's weight publication is a store write too. A store filled with data for *later* steps
therefore blocks the workers' puts, the rows of the next step cannot land, no step commits and
nothing is ever freed. Pausing admission for later steps while the store is full prevents that;
pausing the next step's own groups would cause it.

Guarantees:

- the groups of the next optimizer step are always admitted (fewer than ``groups_per_step``
  groups admitted and untrained);
- a group for a later step is admitted only while the fullest node's store is under
  ``high_water`` of its capacity and the store would stay under it with every admitted, untrained
  group's data in it plus this group's, at the measured bytes a group holds (measured as the
  bytes held per landed group, so weights and reserved grants count too); until the first
  measurement no group for a later step is admitted. Nothing runs out of memory either way (the
  store's puts wait for capacity) and no row is dropped;
- a store that cannot hold what the next step needs is reported instead of waited on forever:
  `stalled` is true once puts wait, every started task one of them, and the progress mark has
  not changed for ``stall_s`` seconds since that was first seen.

Pooled segments (freed, kept warm for reuse) do not count as held: the store gives them up
before a put waits.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StoreBackpressure", "StoreFill", "summarize"]


@dataclass(frozen=True, slots=True)
class StoreFill:
    """The stores' accounting, summed over nodes (the fullest node named)."""

    capacity: int
    #: bytes in use minus pooled bytes, all nodes.
    held: int
    #: puts waiting for capacity, all nodes.
    waiting: int
    #: the fullest node and its held share of its own capacity.
    fullest_node: str
    fullest: float


def summarize(stats: Mapping[str, Any]) -> StoreFill | None:
    """A `StoreFill` of a ``stats`` reply (one node's, or every node's under ``nodes``); None
    when the reply holds no accounting (no stats fetched yet)."""
    nodes: Mapping[str, Any] = stats.get("nodes") or {str(stats.get("node", "")): stats}
    capacity = held = waiting = 0
    fullest_node, fullest = "", -1.0
    for name, node in nodes.items():
        if not isinstance(node, Mapping) or "capacity_bytes" not in node:
            continue
        cap = int(node["capacity_bytes"])
        used = int(node.get("used_bytes", 0)) - int(node.get("pooled_bytes", 0))
        capacity += cap
        held += used
        waiting += int(node.get("waiting_puts", 0))
        share = used / cap if cap > 0 else 1.0
        if share > fullest:
            fullest_node, fullest = str(name), share
    if capacity <= 0:
        return None
    return StoreFill(capacity, held, waiting, fullest_node, fullest)


class StoreBackpressure:
    """Admission against the store's fill, and detection of a store too small to make a step."""

    def __init__(self, *, high_water: float, groups_per_step: int, stall_s: float = 6.0) -> None:
        if not 0.0 < high_water <= 1.0:
            raise ValueError(f"store_high_water must be in (0, 1], got {high_water}")
        self.high_water = high_water
        self.groups_per_step = groups_per_step
        #: how long puts must wait with nothing else moving before `stalled` says so; longer
        #: than a store server's reserve poll (5 s), so that a dead writer's last reserve, still
        #: counted as waiting, has ended.
        self.stall_s = stall_s
        self.fill: StoreFill | None = None
        #: bytes the store holds per landed group (None until measured).
        self.group_bytes: float | None = None
        self.paused = False
        #: times admission started waiting for the store.
        self.pauses = 0
        #: batches of frees sent to the store (part of the controller's progress mark).
        self.free_batches = 0
        self._paused_s = 0.0
        self._paused_at = 0.0
        self._suspect: tuple[Hashable, float] | None = None  # (progress mark, since)

    # -- inputs ---------------------------------------------------------------------------------

    def observe(self, stats: Mapping[str, Any], landed_groups: int) -> None:
        """Fresh ``stats`` from the store; `landed_groups`: live groups whose data the first
        stage wrote, counted before ``stats`` was asked for (so the bytes per group measured
        err high, on the side of pausing)."""
        fill = summarize(stats)
        if fill is None:
            return
        self.fill = fill
        if landed_groups > 0:
            self.group_bytes = max(0, fill.held) / landed_groups

    # -- admission ------------------------------------------------------------------------------

    def room(self, untrained: int) -> bool | None:
        """Whether one more group may be admitted while `untrained` admitted groups are not
        trained yet; None when that depends on a group's bytes, not measured yet."""
        if untrained < self.groups_per_step:
            return True  # the next step's groups: holding them back could only deadlock
        fill = self.fill
        if fill is not None and fill.fullest > self.high_water:
            return False
        if fill is None or self.group_bytes is None:
            return None
        return (untrained + 1) * self.group_bytes <= self.high_water * fill.capacity

    def admits(self, untrained: int, now: float) -> bool:
        """`room`, recording when admission starts and stops waiting for the store (an
        unmeasured group size is not counted as a pause)."""
        room = self.room(untrained)
        if room is False and not self.paused:
            self.paused = True
            self.pauses += 1
            self._paused_at = now
        elif room and self.paused:
            self.paused = False
            self._paused_s += now - self._paused_at
        return room is True

    def paused_s(self, now: float) -> float:
        """Seconds admission has waited for the store so far, the current wait included."""
        return self._paused_s + (now - self._paused_at if self.paused else 0.0)

    # -- stalls ---------------------------------------------------------------------------------

    def stalled(self, mark: Hashable, started: int, now: float) -> bool:
        """Call with fresh `fill` when nothing happened for a while. `mark` changes whenever the
        run progresses (a task starts or ends, a step commits, a worker comes or goes, memory is
        freed); `started`: tasks in flight that a worker has started. True once puts wait with
        every started task among them, `mark` unchanged for `stall_s` seconds since that was
        first seen. A look in between that finds fewer puts waiting does not restart the clock
        while `mark` stands still: a put between two reserve polls is not counted as waiting
        for that instant, and a put that got its room ends its task, which moves `mark`."""
        fill = self.fill
        if self._suspect is not None and self._suspect[0] != mark:
            self._suspect = None
        if fill is None or fill.waiting <= 0 or started > fill.waiting:
            return False
        if self._suspect is None:
            self._suspect = (mark, now)
            return False
        return now - self._suspect[1] >= self.stall_s

    def waited_s(self, now: float) -> float:
        """How long the current suspected stall has lasted (0 when none)."""
        return 0.0 if self._suspect is None else now - self._suspect[1]

    def too_small(self, *, weights_bytes: int | None, now: float) -> str:
        """The error that stops a run stuck on its store: the capacity, what waits, what one
        step needs, and the recipe field to raise."""
        fill = self.fill
        assert fill is not None
        g = self.groups_per_step
        mib = fill.capacity / (1 << 20)
        if self.group_bytes is not None:
            need = f"{g} groups x ~{self.group_bytes:.0f} bytes"
            total = g * self.group_bytes + (weights_bytes or 0)
            need += (f" + one weight version of {weights_bytes} bytes" if weights_bytes
                     else " + one weight version")
            need += f" = about {total:.0f} bytes"
        else:
            need = f"{g} groups of samples + one weight version"
        return (
            f"the sample store is too small for one optimizer step: {fill.waiting} put(s) "
            f"have waited {self.waited_s(now):.1f}s or longer for more than the "
            f"{max(0, fill.capacity - fill.held)} free bytes of its {fill.capacity}-byte capacity "
            f"({mib:.2f} MiB; node {fill.fullest_node!r} {fill.fullest:.0%} held), no task is "
            f"running that could free any, and nothing is freed before the step commits. One step "
            f"needs {need}. Raise placement.store_capacity_mb (PipelineSpec."
            f"store_capacity_bytes) or shrink the step (trainer.groups_per_step)."
        )

    # -- introspection --------------------------------------------------------------------------

    def statistics(self, now: float) -> dict[str, Any]:
        """JSON-ready: whether admission waits for the store, how often and how long it did,
        and what the decision was based on."""
        fill = self.fill
        return {
            "paused": self.paused,
            "pauses": self.pauses,
            "paused_s": round(self.paused_s(now), 4),
            "high_water": self.high_water,
            "held_bytes": None if fill is None else fill.held,
            "capacity_bytes": None if fill is None else fill.capacity,
            "fullest": None if fill is None else round(fill.fullest, 4),
            "waiting_puts": None if fill is None else fill.waiting,
            "group_bytes": None if self.group_bytes is None else round(self.group_bytes),
        }
