"""A real multi-process run with simulated workers over real sockets and shared memory."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random

import pytest

from flowrl.control.collector import RUN_GC_THRESHOLD
from flowrl.controller import Controller, RunError
from flowrl.pipeline import PipelineSpec, PoolSpec, grpo_stages

# Tiny modelled costs so a run takes a fraction of a second of simulated compute.
FAST = {
    "prompt_len": 8, "max_new_tokens": 64, "log_mean": 2.5, "log_sigma": 0.8,
    "rollout_base_s": 0.001, "rollout_token_s": 0.0002, "reward_token_s": 0.0,
    "reference_token_s": 0.0, "train_token_s": 0.00002, "train_step_s": 0.005,
    "weight_numel": 1024,
}


def spec(max_staleness: int, *, rollout: int = 2, reference: bool = False) -> PipelineSpec:
    return PipelineSpec(
        stages=grpo_stages(group_size=4, train_micro_groups=2, reference=reference),
        pools=(
            PoolSpec("rollout", count=rollout, per_process=rollout),
            PoolSpec("reward", count=1),
            *((PoolSpec("reference", count=1),) if reference else ()),
            PoolSpec("train", count=1),
        ),
        group_size=4, groups_per_step=4, max_staleness=max_staleness,
        engine="sim", engine_config=FAST, store_capacity_bytes=64 << 20,
        heartbeat_s=0.5, heartbeat_timeout_s=10.0,
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("staleness", [0, 1])
async def test_run_trains_every_row_once_within_the_staleness_bound(staleness: int) -> None:
    async with Controller(spec(staleness, reference=True)) as ctl:
        out = await ctl.run(steps=4, timeout_s=60)
        status = ctl.status()
    assert out["version"] == 4
    assert out["samples"] == 4 * 4 * 4
    assert out["rows_trained_twice"] == 0
    assert set(out["staleness"]) <= set(range(staleness + 1))
    if staleness == 0:
        assert out["staleness"] == {0: 64}
        # each step after the first is admitted while the step before trains, one step past
        # the gate (no worker may generate it yet); none for a step past the run's last
        assert ctl.scheduler.admitted_ahead == 3 * 4
        # and handed out to workers that loaded that version, idle: each such worker's wait
        # is counted once, from its `served` to its first task; at least one a step
        assert 3 <= len(ctl.version_wait_us) <= 3 * 2, list(ctl.version_wait_us)
        assert all(w >= 0 for w in ctl.version_wait_us)
    else:  # and, further ahead, while the workers are busy with the steps before
        assert ctl.scheduler.admitted_ahead >= 3 * 4
    assert status["worker_deaths"] == 0
    # every task sent is counted in the pass that sent it
    assert sum(ctl.dispatch_pass_tasks) == len(ctl.dispatch_us) > 0
    assert len(ctl.dispatch_cpu_us) == len(ctl.dispatch_us)
    # a pass's CPU cannot exceed its wall time (both counted from the pass's start)
    assert all(0 <= c <= w + 50 for c, w in zip(ctl.dispatch_cpu_us, ctl.dispatch_us,
                                                 strict=True))
    assert min(ctl.dispatch_pass_tasks) >= 1


@pytest.mark.timeout(90)
async def test_a_bound_lowered_and_raised_at_every_step_trains_every_row_once() -> None:
    # Groups admitted ahead under a bound that is then lowered are given back: kept, they
    # would wait for a version the trainer cannot reach without them, and the run would stall.
    bounds = random.Random(5)
    loop = asyncio.get_running_loop()

    def change(e: object) -> None:
        # In the commit's callback, or one or two turns of the event loop later: after the
        # commit's pass and the first chunk it admits ahead (`Controller._admit_ahead`), before
        # any worker loads the new version. A bound raised between two chunks lets the next
        # one take groups of the gate's own steps, which a worker may take at once.
        n = bounds.choice([0, 1, 2])
        turns = bounds.randrange(3)
        if turns == 0:
            ctl.set_max_staleness(n)
        elif turns == 1:
            loop.call_soon(ctl.set_max_staleness, n)
        else:
            loop.call_soon(loop.call_soon, ctl.set_max_staleness, n)

    async with Controller(spec(2, rollout=4)) as ctl:
        ctl.on_step.append(change)
        out = await ctl.run(steps=20, timeout_s=60)
    assert out["version"] == 20
    assert out["samples"] == 20 * 4 * 4
    assert out["rows_trained_twice"] == 0
    assert ctl.scheduler.admitted_ahead > 0


@pytest.mark.timeout(90)
async def test_what_lives_at_start_is_frozen_for_the_run_and_given_back_at_close() -> None:
    """Collections during a run skip the objects alive at its start and at each commit, a full
    one comes at the commits it is due, and the collector is as it was once the run closes."""
    before = gc.get_threshold()
    async with Controller(spec(1)) as ctl:
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (RUN_GC_THRESHOLD, *before[1:])
        ctl.collector.full_every_s = 0.0
        ctl.collector.next_full_at = 0.0  # due at the first commit
        out = await ctl.run(steps=3, timeout_s=60)
        assert ctl.collector.full_collections >= 1
        assert gc.get_freeze_count() > 0  # frozen again after it
    assert out["rows_trained_twice"] == 0
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


@pytest.mark.timeout(90)
async def test_a_freeze_made_before_the_controller_is_left_as_it_was() -> None:
    """A notebook that froze its own objects keeps them frozen after a controller closes."""
    gc.freeze()
    before = gc.get_threshold()
    try:
        async with Controller(spec(1)) as ctl:
            assert gc.get_threshold() == before
            await ctl.run(steps=1, timeout_s=60)
        # (the count itself drifts: frozen objects that die leave it)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


@pytest.mark.timeout(90)
async def test_a_run_that_times_out_wakes_whoever_waits_for_its_end() -> None:
    """``wait_for(lambda: running.done())`` returns when only the run's deadline passed: no
    step and no worker event happens then, so the end of `run` itself must wake it."""
    async with Controller(spec(1)) as ctl:
        ctl.pause()  # nothing is dispatched: the run cannot finish before its deadline
        running = asyncio.ensure_future(ctl.run(steps=1, timeout_s=0.5))
        async with asyncio.timeout(20):
            await ctl.wait_for(running.done)
        with pytest.raises(TimeoutError):
            await running
        ctl.resume()
        assert (await ctl.run(steps=1, timeout_s=60))["version"] == 1


@pytest.mark.timeout(90)
async def test_a_killed_rollout_process_loses_nothing() -> None:
    two_procs = spec(1, rollout=2)
    two_procs = dataclasses.replace(
        two_procs, pools=(PoolSpec("rollout", count=2, per_process=1), *two_procs.pools[1:]))
    async with Controller(two_procs) as ctl:
        run = asyncio.ensure_future(ctl.run(steps=6, timeout_s=60))
        await ctl.wait_for(lambda: ctl.version >= 2)
        victim = ctl.worker_pids("rollout")[0]
        ctl.kill_worker_process(victim)
        await ctl.wait_for(lambda: ctl.worker_deaths >= 1)
        out = await run
        assert ctl.status()["errors"], "the death is reported"
    assert out["version"] == 6
    assert out["rows_trained_twice"] == 0
    assert out["samples"] == 6 * 16


@pytest.mark.timeout(90)
async def test_a_killed_trainer_is_restarted_and_its_step_redone() -> None:
    async with Controller(spec(1)) as ctl:
        run = asyncio.ensure_future(ctl.run(steps=5, timeout_s=60))
        await ctl.wait_for(lambda: ctl.version >= 2)
        ctl.kill_worker_process(ctl.worker_pids("train")[0])
        out = await run
        assert ctl.restarts == 1
    assert out["version"] == 5
    assert out["rows_trained_twice"] == 0
    assert out["samples"] == 5 * 16


@pytest.mark.timeout(90)
async def test_a_missed_weight_sync_names_the_worker_and_version_and_stops_the_run() -> None:
    # Every rollout load takes 30 s against a 0.3 s deadline: the worker reports, exits, is
    # restarted, joins at the current version with its weights, misses again, and the run stops
    # with the reason instead of waiting forever.
    stuck = dataclasses.replace(
        spec(0, rollout=1), engine_config={**FAST, "weight_load_s": 30.0},
        weight_sync_timeout_s=0.3, max_restarts=1, restart_backoff_s=0.05)
    async with Controller(stuck) as ctl:
        with pytest.raises(RunError, match=r"rollout\.0 died 2 times") as info:
            await ctl.run(steps=3, timeout_s=60)
        errors = [e for e in ctl.status()["errors"] if e.get("stage") == "weight_sync"]
    assert "did not load policy version 1 within 0.3s" in str(info.value)
    assert errors
    assert errors[0]["version"] == 1
    assert errors[0]["name"] == "rollout.0.0"
    assert "rollout.0.0" in errors[0]["error"]


@pytest.mark.timeout(90)
async def test_a_resumed_controller_trains_every_position_exactly_once() -> None:
    sim = dataclasses.replace(spec(1), max_staleness=1)
    async with Controller(sim) as ctl:
        await ctl.run(steps=3, timeout_s=60)
        state = ctl.run_state()
    # Rollout ran ahead: positions of step 4 were admitted and are redone on resume. One of
    # them may have been trained before a late position of step 3 (seen on busy cores).
    assert state.version == 3
    assert state.trained_below + len(state.trained_above) == state.groups_trained == 12
    assert state.admitted_to > 12
    assert state.redo()
    async with Controller(sim, resume=state) as ctl:
        out = await ctl.run(steps=3, timeout_s=60)
        final = ctl.run_state()
    assert out["version"] == 6
    assert out["samples"] == 3 * 16
    # Every trained position once (the count equals the set's size) and the first run's
    # in-flight positions among them. Rollout may run ahead here too, so groups can finish
    # out of order: position 24 may be trained before 23 (seen on busy cores).
    trained = final.trained_below + len(final.trained_above)
    assert final.groups_trained == trained == 6 * 4
    assert all(p < final.trained_below or p in final.trained_above for p in state.redo())


@pytest.mark.timeout(90)
async def test_a_pause_as_a_step_ends_drains_after_its_commit_and_says_its_version() -> None:
    # The last task of a paused run is the step's last micro-batch: its report commits the
    # step, and "drained" comes after that, with the new version (it came first, with the
    # version before, and a client that took "drained" to mean "nothing changes now" saw the
    # version move).
    slow_train = {**FAST, "train_step_s": 0.3}
    async with Controller(dataclasses.replace(spec(0), engine_config=slow_train)) as ctl:
        train = ctl.scheduler.train
        assert train is not None
        running = asyncio.ensure_future(ctl.run(steps=3, timeout_s=60))
        await ctl.wait_for(lambda: running.done() or any(
            a.task.stage == train.name and a.params.get("step_end") for a in ctl.assignments))
        ctl.pause()
        version = ctl.version
        await ctl.wait_for(lambda: not ctl.assignments)
        (drained,) = [e for e in ctl.events.recent if e["kind"] == "drained"]
        assert ctl.version == version + 1  # the step committed
        assert drained["version"] == ctl.version
        ctl.resume()
        assert (await running)["version"] == 3
