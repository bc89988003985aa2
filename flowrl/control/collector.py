"""The garbage collector while a run is on: no collection inside a step.

CPython's cyclic collector scans a generation's objects each time it runs. In the controller
most objects live long: what lives when the run starts (imports, torch, the pipeline, a
notebook's state) lives for the run, and what lives when a step commits is mostly what the next
steps hold (rows, tasks and handles in flight), which reference counting frees, not the
collector. Scanning them again and again is the whole cost: at 1,024 workers a young collection
every 700 net allocations (Python's default) took 6-11 µs of CPU a trained sample, and with a
threshold of 20,000 each one scans 20,000 objects at once (5-11 ms, finding no garbage),
landing inside dispatch passes.

So while a run is on, the controller's process

- freezes what lives at the start and again at every step's commit (`gc.freeze`, O(1)): a young
  collection only ever scans what the current step allocated, and, since a freeze restarts the
  count, a step that allocates fewer than `RUN_GC_THRESHOLD` objects is never interrupted by
  one;
- unfreezes and collects everything at the first commit a minute (`FULL_COLLECTION_S`) after the
  last: a cycle that became garbage after it was frozen (one made by a user's ``on_step``, an
  HTTP client of the monitor) is freed then, so what a freeze keeps is bounded by a minute of
  the run (~0.1 s at 1,024 workers, once a minute). Where that collection is long (a notebook
  holding millions of objects) the next one waits longer, so that full collections stall the
  loop for at most 1% of the run (`FULL_COLLECTION_SHARE`);
- and gives the collector back as it found it at close.

Not when something froze the collector before the run (a notebook's own `gc.freeze`, or another
controller in the same process): `gc.unfreeze` cannot tell whose objects are whose, so the
collector is left to whoever set it first.
"""

from __future__ import annotations

import gc
import time

__all__ = ["FULL_COLLECTION_S", "FULL_COLLECTION_SHARE", "RUN_GC_THRESHOLD", "RunCollector"]

#: net allocations between young collections while a run is on
RUN_GC_THRESHOLD = 20_000
#: the least time between two full collections (at step commits)
FULL_COLLECTION_S = 60.0
#: the most of the run's time full collections may take: a longer one puts off the next
FULL_COLLECTION_SHARE = 0.01


class RunCollector:
    def __init__(self, *, full_every_s: float = FULL_COLLECTION_S) -> None:
        self.full_every_s = full_every_s
        #: full collections made at commits; the objects the last one freed, and its seconds
        self.full_collections = 0
        self.last_freed = 0
        self.last_full_s = 0.0
        #: when the next full collection is due (the clock `start` and `committed` are given)
        self.next_full_at = 0.0
        self._before: tuple[int, int, int] | None = None

    @property
    def owned(self) -> bool:
        """Whether this run set the collector (and gives it back at close)."""
        return self._before is not None

    def start(self, now: float) -> None:
        """The run starts (``now``: a monotonic clock in seconds)."""
        if self._before is not None or gc.get_freeze_count():
            return
        gc.freeze()
        self._before = gc.get_threshold()
        young, *older = self._before
        gc.set_threshold(max(young, RUN_GC_THRESHOLD), *older)
        self.next_full_at = now + self.full_every_s

    def committed(self, now: float) -> None:
        """A step committed: freeze what lives, or collect everything once a minute."""
        if self._before is None:
            return
        if now >= self.next_full_at:
            began = time.perf_counter()
            gc.unfreeze()
            self.last_freed = gc.collect()
            self.last_full_s = time.perf_counter() - began
            self.full_collections += 1
            self.next_full_at = now + max(self.full_every_s,
                                          self.last_full_s / FULL_COLLECTION_SHARE)
        gc.freeze()

    def close(self) -> None:
        """Put the collector back as it was before `start`."""
        if self._before is None:
            return
        gc.set_threshold(*self._before)
        self._before = None
        gc.unfreeze()  # cycles among what was frozen are collected again
