"""What the monitor sees of a run: a read-only view and four control calls.

The monitor depends on this protocol, not on the controller, so it can be tested against
anything that has these members and the controller can change shape without touching it (an
import-linter contract forbids ``flowrl.monitor`` to import ``flowrl.controller``). The
controller satisfies it; mypy checks that where the controller hands itself to `MonitorServer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flowrl.events import EventBus
    from flowrl.run_trace import TraceRecord

__all__ = ["RunView"]


class RunView(Protocol):
    @property
    def run_id(self) -> str: ...

    @property
    def node(self) -> str:
        """The controller's node (the store's node when its status does not name one)."""
        ...

    @property
    def events(self) -> EventBus:
        """Events and activity spans, for ``/events``, ``/trace`` and task durations."""
        ...

    @property
    def version(self) -> int: ...

    @property
    def paused(self) -> bool: ...

    @property
    def max_staleness(self) -> int: ...

    def roles(self) -> list[str]:
        """The run's roles in pipeline order (the trace's process order)."""
        ...

    def worker_roles(self) -> list[tuple[str, str]]:
        """``(worker id, role)`` of every registered worker (the trace's lanes)."""
        ...

    def plan_trace(self) -> tuple[dict[str, Any], list[TraceRecord]]:
        """The run's trace so far (`flowrl.run_trace`: its header and records), for
        ``GET /plan-trace``; a snapshot, cheap enough for the event loop."""
        ...

    def status(self) -> dict[str, Any]:
        """A JSON-ready snapshot: exactly what ``GET /status`` serves."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stop(self) -> None: ...

    def set_max_staleness(self, n: int) -> None: ...
