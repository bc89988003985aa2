"""The dashboard in a real browser (Debian's chromium through Playwright) on a live run.

Playwright's sync API wants the main thread, so the controller and its run live in a
background thread with their own event loop; the test talks to them over HTTP only. The
browser is required: without /usr/bin/chromium the test fails and says how to install it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from playwright.sync_api import Page, sync_playwright

from flowrl.controller import Controller
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from flowrl.recipe import EvalConfig, MonitorConfig

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
DOCS_SHOT = Path(__file__).resolve().parent.parent / "docs" / "dashboard.png"

# Modelled costs large enough for the timeline to show each task as a visible bar, small
# enough for a step every few hundred milliseconds.
VISIBLE = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.03, "rollout_token_s": 0.003, "reward_token_s": 0.0005,
    "reference_token_s": 0.0005, "train_token_s": 0.0004, "train_step_s": 0.04,
    "weight_numel": 1024,
}


def spec() -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2, reference=True),
        pools=(PoolSpec("rollout", count=4, per_process=4), PoolSpec("reward", count=1),
               PoolSpec("reference", count=1), PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=1,
        engine="sim", engine_config=VISIBLE, store_capacity_bytes=64 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
        eval=EvalConfig(every=2, prompts=4, sampled=2, prompts_per_task=2).model_dump(),
    )


class ServedRun:
    """A controller with a run in progress, in a thread with its own loop (a context manager)."""

    def __init__(self, pipeline: PipelineSpec) -> None:
        self._spec = pipeline
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()),
                                        name="served-run")

    async def _serve(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with Controller(self._spec, monitor=MonitorConfig()) as ctl:
                run = asyncio.ensure_future(ctl.run(steps=10**6))
                await ctl.wait_for(lambda: ctl.version >= 1)
                self.url = ctl.monitor_url or ""
                self._ready.set()
                await self._stop.wait()
                ctl.stop()
                await run
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> ServedRun:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None or not self.url:
            self.__exit__(None, None, None)
            raise RuntimeError("the run did not start") from self._error
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the served run did not stop"
        if self._error is not None and kind is None:
            raise self._error

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "status", timeout=10) as reply:
            data: dict[str, Any] = json.loads(reply.read())
        return data


# Brightly coloured pixels (task bars) in each lane of the timeline canvas.
LANE_PIXELS = """() => {
        const c = document.getElementById('timeline');
        const lanes = Number(c.dataset.lanes), h = Number(c.dataset.lanePx);
        const d = c.getContext('2d').getImageData(0, 0, c.width, lanes * h).data;
        const out = new Array(lanes).fill(0);
        for (let i = 0; i < d.length; i += 4) {
            if (Math.max(d[i], d[i + 1], d[i + 2]) > 100) out[Math.floor(i / 4 / c.width / h)]++;
        }
        return out;
    }"""


def lane_pixels(page: Page) -> list[int]:
    counts: list[int] = page.evaluate(LANE_PIXELS)
    return counts


@pytest.mark.timeout(90)
def test_dashboard_renders_live_charts_and_one_timeline_lane_per_worker(tmp_path: Path) -> None:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing; install it with: apt-get install -y chromium")
    with ServedRun(spec()) as served, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(served.url)
            workers = len(served.status()["workers"])
            assert workers == 7
            page.wait_for_function("Number(document.body.dataset.steps || 0) >= 3",
                                   timeout=30_000)
            page.wait_for_function(
                f"document.getElementById('timeline').dataset.lanes === '{workers}' && "
                "Number(document.getElementById('timeline').dataset.spans) > 20",
                timeout=30_000)
            assert page.locator("#lane-labels .lane").count() == workers
            # Charts: a line with a point per step so far, staleness bars, the store bar.
            for chart in ("#reward-chart", "#throughput-chart"):
                points = page.get_attribute(f"{chart} polyline", "points") or ""
                assert len(points.split()) >= 3, chart
            # Held-out accuracy: a greedy and a sampled line, a point per evaluation round.
            page.wait_for_function("Number(document.body.dataset.evals || 0) >= 2",
                                   timeout=30_000)
            lines = page.locator("#eval-chart polyline")
            assert lines.count() == 2
            assert all(len((lines.nth(i).get_attribute("points") or "").split()) >= 2
                       for i in range(2))
            assert "greedy" in (page.text_content("#eval-last") or "")
            assert page.locator("#staleness-chart rect.bar").count() >= 1
            assert page.locator("#store-chart rect.bar").count() == 1
            assert page.locator("#stages tbody tr").count() == 4
            # Live: the page follows the run without a reload, and every lane shows work.
            version = int(page.get_attribute("body", "data-version") or 0)
            steps = int(page.get_attribute("body", "data-steps") or 0)
            page.wait_for_function(
                f"Number(document.body.dataset.version) > {version} && "
                f"Number(document.body.dataset.steps) > {steps}", timeout=30_000)
            page.wait_for_function(f"Math.min(...({LANE_PIXELS})()) > 0", timeout=30_000)
            pixels = lane_pixels(page)
            assert len(pixels) == workers
            assert min(pixels) > 0, pixels
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert (tmp_path / "dashboard.png").stat().st_size > 10_000
            if os.environ.get("FLOWRL_UPDATE_SCREENSHOT"):  # refresh the README's picture
                DOCS_SHOT.parent.mkdir(exist_ok=True)
                shutil.copyfile(tmp_path / "dashboard.png", DOCS_SHOT)
            assert not errors, errors
        finally:
            browser.close()
