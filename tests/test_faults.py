"""Faults a run must survive, injected into real multi-process runs (simulated workers, real
sockets and shared memory): a stopped (not killed) worker, and reports a worker cannot have
meant."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from typing import Any

import pytest

from flowrl import messages as m
from flowrl.controller import Controller
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages
from transport.endpoints import ipc_endpoint
from transport.pubsub import DroppedSubscriber
from transport.rpc import RpcClient

FAST = {
    "prompt_len": 8, "max_new_tokens": 32, "log_mean": 2.0, "log_sigma": 0.5,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0001, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00001, "train_step_s": 0.002,
    "weight_numel": 256,
}


def spec(**changes: Any) -> PipelineSpec:
    base = PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2),
        pools=(PoolSpec("rollout", count=1), PoolSpec("reward", count=1),
               PoolSpec("train", count=1)),
        group_size=4, groups_per_step=4, max_staleness=1, engine="sim", engine_config=FAST,
        store_capacity_bytes=64 << 20, heartbeat_s=0.2, heartbeat_timeout_s=2.0,
        max_restarts=5, restart_backoff_s=0.05)
    return dataclasses.replace(base, **changes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("role", ["train", "rollout"])
async def test_a_stopped_worker_is_killed_and_restarted_and_the_run_keeps_training(
        role: str) -> None:
    # SIGSTOP keeps the process alive with its sockets open: only missed heartbeats tell. The
    # pool has one process, so without a restart the run would wait forever.
    async with Controller(spec()) as ctl:
        run = asyncio.ensure_future(ctl.run(steps=6, timeout_s=90))
        await ctl.wait_for(lambda: ctl.version >= 2)
        victim = ctl.worker_pids(role)[0]
        os.kill(victim, signal.SIGSTOP)
        await ctl.wait_for(lambda: victim not in ctl.worker_pids(role)
                           and bool(ctl.worker_pids(role)))
        out = await run
        downs = [e for e in ctl.status()["errors"] if "missed heartbeats" in e.get("error", "")]
        assert ctl.restarts >= 1
    assert downs, "the verdict is reported"
    assert out["version"] == 6
    assert out["rows_trained_twice"] == 0
    assert out["samples"] == 6 * 16


class _Impostor:
    """A worker of the reward pool that answers every task it takes with a malformed report."""

    def __init__(self, ctl: Controller) -> None:
        self.rpc = RpcClient(ipc_endpoint(ctl.run_id, "ctl"), timeout=10.0)
        self.me: dict[str, Any] = {}

    async def register(self) -> None:
        reply = await self.rpc.call(m.OP_REGISTER, {
            "name": "reward.bad.0", "role": "reward", "node": "node0", "pid": os.getpid(),
            "capacity": 1})
        self.me = {"worker_id": reply["worker_id"], "token": reply["token"]}

    async def poll(self, done: dict[str, Any] | None = None) -> m.TaskMsg | None:
        """As a worker polls: the previous task's report rides on the poll for the next."""
        request: dict[str, Any] = {**self.me, "wait_s": 5.0}
        if done is not None:
            request["done"] = {"worker_id": self.me["worker_id"], **done}
        task: m.TaskMsg | None = await self.rpc.call(m.OP_GET_TASK, request)
        return task

    async def report_alone(self, report: dict[str, Any]) -> Any:
        return await self.rpc.call(m.OP_TASK_DONE, {**self.me, **report})


def _malformed(task: m.TaskMsg, kind: str) -> dict[str, Any]:
    n = len(task["rows"])
    base = {"task_id": task["task_id"], "lengths": [], "version": None, "metrics": {}}
    if kind == "missing":
        return {**base, "fields": {}}
    if kind == "unknown":
        return {**base, "fields": {"reward": [1.0] * n, "bogus": [1.0] * n}}
    if kind == "wrong_length":
        return {**base, "fields": {"reward": [1.0] * (n + 1)}}
    if kind == "wrong_lengths":
        return {**base, "fields": {"reward": [1.0] * n}, "lengths": [1] * (n + 3)}
    assert kind == "not_a_handle"
    return {**base, "fields": {"reward": [{"x": 1}] * n}}


@pytest.mark.timeout(120)
async def test_malformed_reports_fail_their_tasks_and_every_row_trains_exactly_once() -> None:
    kinds = ["missing", "unknown", "wrong_length", "wrong_lengths", "not_a_handle"]
    # The real reward worker is slow, so that it is busy when reward tasks come: the scheduler
    # gives an idle worker the next task, and the impostor is idle whenever it polls.
    slow_reward = spec(max_task_failures=20,
                       engine_config={**FAST, "reward_token_s": 0.002})
    async with Controller(slow_reward) as ctl:
        bad = _Impostor(ctl)
        try:
            await bad.register()
            run = asyncio.ensure_future(ctl.run(steps=5, timeout_s=90))
            pending: dict[str, Any] | None = None
            for i, kind in enumerate(kinds):
                task = None
                while task is None:  # each poll waits up to 5 s; the run's timeout bounds it
                    assert not run.done(), "the run ended before the impostor got 5 tasks"
                    task, pending = await bad.poll(pending), None
                report = _malformed(task, kind)
                if i % 2:
                    await bad.report_alone(report)
                else:
                    pending = report
            if pending is not None:
                await bad.report_alone(pending)
            await bad.rpc.call(m.OP_BYE, bad.me)
        finally:
            await bad.rpc.aclose()
        out = await run
        refused = [e for e in ctl.status()["errors"]
                   if "malformed task report" in e.get("error", "")]
    assert len(refused) == len(kinds)
    assert out["version"] == 5
    assert out["rows_trained_twice"] == 0
    assert out["samples"] == 5 * 16
    ctl.index.audit()  # the index's own books balance (raises if not)


@pytest.mark.timeout(120)
async def test_a_worker_dropped_for_not_reading_broadcasts_is_restarted() -> None:
    # The publisher's verdict (`transport.pubsub`, tested there with a subscriber that never
    # reads) reaches the workforce as a `DroppedSubscriber` with the name the worker subscribed
    # under, its own (`workers.runtime`): what the controller then does is tested here, with
    # the verdict handed over as the publisher would.
    async with Controller(spec()) as ctl:
        run = asyncio.ensure_future(ctl.run(steps=5, timeout_s=90))
        await ctl.wait_for(lambda: ctl.version >= 1)
        [trainer] = ctl.registry.of_role("train")
        old = trainer.pid
        ctl.workforce.subscriber_dropped(DroppedSubscriber(
            name=trainer.name, token="t", reason="took no message for 10.0 s", connected=True))
        out = await run
        assert old not in ctl.worker_pids("train")
        assert ctl.restarts >= 1
        downs = [e for e in ctl.status()["errors"] if "stopped reading broadcasts" in
                 e.get("error", "")]
    assert downs
    assert out["version"] == 5
    assert out["rows_trained_twice"] == 0
