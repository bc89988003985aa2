"""Event-loop lag: how late a timer callback runs, sampled a few times a second.

A controller whose loop lags is slow to answer workers (every request waits behind whatever
hogs the loop), so the lag is part of `Controller.status()` and of `/metrics`. The probe is one
owned task that sleeps a fixed interval and records by how much the wake-up overshot it; the
sleep *is* the measurement, not a polling loop.
"""

from __future__ import annotations

import asyncio
import collections

#: samples kept for the recent maximum: one minute at the default interval.
WINDOW = 240


class LoopLag:
    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.last_s = 0.0
        self.max_s = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=WINDOW)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval_s)
            self.observe(loop.time() - before - self.interval_s)

    def observe(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self.last_s = lag_s
        self.max_s = max(self.max_s, lag_s)
        self._recent.append(lag_s)

    def snapshot(self) -> dict[str, float]:
        """Last sample, the worst of the last minute and the worst since start, in ms."""
        return {"last_ms": self.last_s * 1e3,
                "recent_max_ms": max(self._recent, default=0.0) * 1e3,
                "max_ms": self.max_s * 1e3}
