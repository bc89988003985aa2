"""Live monitoring of a running controller: an HTTP endpoint, metrics, traces, a dashboard.

- `MonitorServer` (``server.py``) — the aiohttp app the controller starts when it is given a
  `flowrl.recipe.MonitorConfig`: ``/status``, ``/metrics``, ``/events`` (SSE), ``/trace``,
  the dashboard at ``/`` and token-guarded ``POST /pause|/resume|/stop|/staleness``;
- `ControllerMetrics` (``metrics.py``) — Prometheus families in a per-controller registry;
- `chrome_trace` (``trace.py``) — activity spans as Chrome trace-event / Perfetto JSON;
- `LoopLag` (``lag.py``) — the controller's event-loop lag probe;
- `RunView` (``view.py``) — what the monitor reads of a run and may ask of it (a protocol the
  controller satisfies);
- ``python -m flowrl.monitor URL`` (``__main__.py``) — a live terminal view of ``/status``.
"""

from flowrl.monitor.lag import LoopLag
from flowrl.monitor.metrics import ControllerMetrics
from flowrl.monitor.server import MonitorServer
from flowrl.monitor.trace import chrome_trace
from flowrl.monitor.view import RunView

__all__ = ["ControllerMetrics", "LoopLag", "MonitorServer", "RunView", "chrome_trace"]
