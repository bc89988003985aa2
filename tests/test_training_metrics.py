"""A run's training figures where a user looks for them: each step's line (reward spread,
response length, the staleness bound beside the staleness observed), the progress line, the
Prometheus ``/metrics`` of a real run, and the terminal view, which ends with the run."""

from __future__ import annotations

import asyncio
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowrl.control.ledger import StepCommit
from flowrl.control.step_metrics import step_entry
from flowrl.controller import Controller
from flowrl.launch import _format_step
from flowrl.monitor.__main__ import ended_line
from flowrl.monitor.metrics import STEP_GAUGES
from flowrl.recipe import (
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    MonitorConfig,
    Recipe,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from flowrl.staleness import describe_staleness
from flowrl.tiny_model import build_tiny_model


def _entry(rewards: list[float], *, tokens: int = 12, bound: int | None = 2) -> dict[str, Any]:
    commit = StepCommit(3, {"metrics": {"loss": 0.25}}, samples=len(rewards), rewards=rewards,
                        staleness=[0, 1, 1, 0][:len(rewards)])
    return step_entry(commit, served_versions=[2, 3], wall_s=1.0, since_last_s=0.5, stages={},
                      response_tokens=tokens, max_staleness=bound)


def test_a_steps_line_has_its_reward_spread_response_length_and_staleness_bound() -> None:
    e = _entry([1.0, 0.0, 1.0, 0.0])
    assert e["reward_mean"] == 0.5
    assert e["reward_std"] == 0.5
    assert e["response_length_mean"] == 3.0  # 12 response tokens over 4 samples
    assert e["staleness_max"] == 1
    assert e["max_staleness"] == 2
    assert e["train_loss"] == 0.25
    # A reward that is not a finite number makes the spread NaN, never an error.
    assert math.isnan(_entry([math.inf, 0.0])["reward_std"])


def test_the_progress_line_shows_the_staleness_bound_apart_from_the_observed_max() -> None:
    assert describe_staleness(0.5, 1, 2) == "staleness avg 0.50 max 1 (bound 2)"
    assert describe_staleness(0.0, 0, None) == "staleness avg 0.00 max 0"
    line = _format_step(_entry([1.0, 0.0, 1.0, 0.0]))
    assert "  staleness avg 0.50 max 1 (bound 2)  served v2,3" in line
    assert "(max" not in line


def test_the_terminal_view_says_whether_the_run_it_watched_finished() -> None:
    st = {"run_id": "r1", "version": 5, "trainer": {"steps_target": 5}}
    assert ended_line(st) == "run r1 finished: step 5 of 5; its monitor closed"
    st = {"run_id": "r1", "version": 3, "trainer": {"steps_target": 5}}
    assert ended_line(st).startswith("run r1 ended (last seen at step 3 of 5); its monitor closed")


REWARDS = '''
import itertools

_calls = itertools.count()

def every_other_raises(prompt, response, answer):
    if next(_calls) % 2:
        raise RuntimeError("the grader is down")
    return 1.0
'''


class _Output:
    """A subprocess's output, read as it comes (so the process never blocks writing it)."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.data = bytearray()
        self._grew = asyncio.Event()
        self.task = asyncio.ensure_future(self._pump(stream))

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(4096):
            self.data += chunk
            self._grew.set()
        self._grew.set()

    async def wait_for(self, pattern: bytes) -> None:
        while True:
            self._grew.clear()
            if re.search(pattern, self.data):
                return
            assert not self.task.done(), f"the output ended without {pattern!r}"
            await self._grew.wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_real_runs_metrics_are_scraped_and_the_terminal_view_ends_with_it(
    tmp_path: Path,
) -> None:
    model = build_tiny_model(tmp_path / "tiny", hidden=32, layers=1, heads=2, kv_heads=1,
                             vocab_size=300, max_positions=64)
    (tmp_path / "rewards.py").write_text(REWARDS)
    steps = 2
    r = Recipe(
        steps=steps, model=ModelConfig(path=str(model)), data=DataConfig(max_prompt_tokens=16),
        algorithm=AlgorithmConfig(group_size=2),
        reward=RewardConfig(fn=f"{tmp_path / 'rewards.py'}:every_other_raises",
                            max_failure_share=1.0),
        rollout=RolloutConfig(max_new_tokens=4), trainer=TrainerConfig(lr=1e-4, groups_per_step=2),
    )
    async with Controller(r.to_pipeline(), monitor=MonitorConfig()) as ctl:
        assert ctl.monitor_url is not None
        view = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flowrl.monitor", ctl.monitor_url, "--interval", "0.2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "TTY_COMPATIBLE": "1", "TERM": "xterm", "COLUMNS": "200"})
        assert view.stdout is not None
        assert view.stderr is not None
        out, err = _Output(view.stdout), _Output(view.stderr)
        try:
            async with asyncio.timeout(30):
                await out.wait_for(re.escape(ctl.run_id.encode()))  # it has read the run
            await ctl.run(steps=steps, timeout_s=60)
            async with aiohttp.ClientSession() as http, \
                    http.get(ctl.monitor_url + "metrics") as resp:
                assert resp.status == 200
                families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
            async with asyncio.timeout(30):  # its last read is of the finished run
                await out.wait_for(b"version %d " % steps)
        except BaseException:
            view.kill()
            await view.wait()
            raise
    # The controller closed, and its monitor with it: the view ends at once, with a line.
    async with asyncio.timeout(30):
        code = await view.wait()
        await asyncio.gather(out.task, err.task)
    assert code == 0, err.data.decode()
    assert (f"run {ctl.run_id} finished: step {steps} of {steps}; its monitor closed"
            in out.data.decode())

    last = ctl.step_log[-1]
    for key, name, doc in STEP_GAUGES:
        family = families.get(name)
        if key not in last:
            assert family is None, name
            continue
        assert family is not None, name
        assert (family.type, family.documentation) == ("gauge", doc)
        assert family.samples[0].value == pytest.approx(last[key]), name
    for name in ("flowrl_train_loss", "flowrl_train_grad_norm", "flowrl_train_learning_rate",
                 "flowrl_train_entropy_nats", "flowrl_train_mismatch_kl",
                 "flowrl_train_clipped_tokens_ratio", "flowrl_reward_std",
                 "flowrl_response_length_tokens", "flowrl_step_staleness_max"):
        assert name in families, name
    assert families["flowrl_train_learning_rate"].samples[0].value == pytest.approx(1e-4)
    assert families["flowrl_reward_std"].samples[0].value > 0  # one sample of each pair fails
    failed = {(s.labels["stage"], s.labels["kind"]): s.value
              for s in families["flowrl_failed_samples"].samples}
    assert failed == {("reward", "error"): sum(e["reward_failed"] for e in ctl.step_log)}
    assert failed[("reward", "error")] > 0
