"""Nodes lost mid-run, and the sample data that was lost with their stores.

A node agent owns its node's store (`flowrl.node`), so when the agent is lost every field that
workers there wrote is lost too. The run goes on without the node when it can: its workers
are gone and are not restarted there (`Workforce.node_lost` says when the run cannot go on, for
instance when the trainer was there). A live group with a row whose data was on that store can
never be completed. It is dropped, and its prompt admitted again, as a stale group is
(`Scheduler.drop_group`). This waits until no task holds one of its rows. A trained
micro-batch stays in flight until its step commits, and the trainer has already taken its
gradients, so such a group is trained and retired as usual. A task that fails to read the lost
rows gives them back, and then the group is dropped. The store client stops sending frees to
the lost store (`NodeHub.lose` takes it out of the peers).

Exactly-once holds as before: a dropped row is never trained, and a readmitted prompt gets new
rows.
"""

from __future__ import annotations

from collections.abc import Callable

from flowrl.index import Index
from transport.handles import handle_node

__all__ = ["LostNodes"]


class LostNodes:
    def __init__(self, index: Index, drop: Callable[[int], None]) -> None:
        """``drop(gid)``: drop live group ``gid`` and admit its prompt again."""
        self._index = index
        self._drop = drop
        #: the nodes lost so far, in the order they were lost
        self.nodes: list[str] = []
        #: groups dropped because a row's data was on a lost node's store
        self.groups_dropped = 0
        # Groups with lost data that a task still held when last looked at.
        self._waiting: set[int] = set()

    def lost(self, node: str) -> int:
        """``node``'s store is gone: drop the groups that had data there (now, or once no task
        holds them). Returns how many live groups had data there."""
        if node in self.nodes:
            return 0
        self.nodes.append(node)
        held = self._index.groups_holding(lambda h: handle_node(h) == node)
        self._waiting.update(held)
        self.sweep()
        return len(held)

    def sweep(self) -> None:
        """Drop the groups with lost data that no task holds any more (called before each
        dispatch pass; nothing to do unless a node was lost)."""
        if not self._waiting:
            return
        index = self._index
        for gid in list(self._waiting):
            if not index.has_group(gid):  # trained and retired, or dropped as stale meanwhile
                self._waiting.discard(gid)
            elif not index.group_in_flight(gid):
                self._waiting.discard(gid)
                self._drop(gid)
                self.groups_dropped += 1

    @property
    def waiting(self) -> int:
        """Groups with lost data still held by a task."""
        return len(self._waiting)
