"""The reward runner: sync/async/batched user functions, failures that never escape, bounded
threads for hung calls, and resolving function references."""

from __future__ import annotations

import asyncio
import math
import textwrap
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

import workers.roles.reward_runner as reward_mod
from workers.roles.builtin_rewards import exact_match
from workers.roles.reward_runner import (
    RewardFnError,
    RewardResult,
    RewardRunner,
    RewardSample,
    Unparsable,
    resolve_reward_fn,
)

pytestmark = pytest.mark.timeout(20)

SAMPLES = [RewardSample("1+1=", "2", {"answer": "2"}),
           RewardSample("2+2=", "5", {"answer": "4"}),
           RewardSample("3+3=", "6!", {"answer": "6"})]


def runner(fn: Any, *, batched: bool = False, timeout_s: float = 5.0,
           max_concurrency: int = 4) -> RewardRunner:
    return RewardRunner(fn, batched=batched, timeout_s=timeout_s, max_concurrency=max_concurrency)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown, so a deliberately hung function's thread always ends."""
    ev = threading.Event()
    yield ev
    ev.set()


def test_public_api_is_pinned() -> None:
    assert set(reward_mod.__all__) == {
        "FailureKind", "RewardFnError", "RewardResult", "RewardRunner", "RewardSample",
        "RewardStats", "Unparsable", "resolve_reward_fn",
    }


# ---- the four kinds of functions -----------------------------------------------------------------


async def test_sync_per_sample_runs_off_the_loop() -> None:
    seen: list[str] = []

    def fn(prompt: str, response: str, *, answer: str) -> float:
        seen.append(threading.current_thread().name)
        return float(response == answer)

    out = await runner(fn).score(SAMPLES)
    assert out == [RewardResult(1.0, True), RewardResult(0.0, True), RewardResult(0.0, True)]
    assert seen
    assert all(name == "flowrl-reward" for name in seen)


async def test_async_per_sample() -> None:
    async def fn(prompt: str, response: str, **meta: Any) -> float:
        await asyncio.sleep(0)
        return len(prompt) + len(response) + len(meta)

    out = await runner(fn).score(SAMPLES)
    assert [r.reward for r in out] == [6.0, 6.0, 7.0]
    assert all(r.ok for r in out)


async def test_batched_sync_and_async() -> None:
    def sync_fn(prompts: list[str], responses: list[str], metas: list[dict[str, Any]]
                ) -> list[float]:
        return [float(r == m["answer"]) for r, m in zip(responses, metas, strict=True)]

    async def async_fn(prompts: list[str], responses: list[str], metas: list[dict[str, Any]]
                       ) -> tuple[float, ...]:
        return tuple(float(i) for i in range(len(prompts)))

    r = runner(sync_fn, batched=True)
    assert [x.reward for x in await r.score(SAMPLES)] == [1.0, 0.0, 0.0]
    assert r.statistics().calls == 1
    assert [x.reward for x in await runner(async_fn, batched=True).score(SAMPLES)] == [0, 1, 2]


async def test_callable_object_with_async_call() -> None:
    class Scorer:
        async def __call__(self, prompt: str, response: str, **meta: Any) -> float:
            return 0.5

    out = await runner(Scorer()).score(SAMPLES[:1])
    assert out == [RewardResult(0.5, True)]


async def test_empty_input() -> None:
    assert await runner(exact_match).score([]) == []


async def test_the_loop_stays_free_during_a_sync_call() -> None:
    gate = threading.Event()

    def fn(prompt: str, response: str, **meta: Any) -> float:
        # Returns only if the event loop runs the coroutine below meanwhile.
        return 1.0 if gate.wait(timeout=10) else -1.0

    async def open_gate() -> None:
        gate.set()

    async with asyncio.TaskGroup() as tg:
        scoring = tg.create_task(runner(fn).score(SAMPLES[:1]))
        tg.create_task(open_gate())
    assert scoring.result() == [RewardResult(1.0, True)]


async def test_concurrency_is_bounded() -> None:
    lock = threading.Lock()
    active = peak = 0
    barrier = threading.Barrier(3, timeout=5)

    def fn(prompt: str, response: str, **meta: Any) -> float:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        try:
            barrier.wait()  # breaks (and the sample fails) unless 3 calls run together
            return 1.0
        finally:
            with lock:
                active -= 1

    samples = [RewardSample("p", "r")] * 9
    out = await runner(fn, max_concurrency=3).score(samples)
    assert all(r.ok for r in out), [r.error for r in out]
    assert peak == 3


# ---- failures ------------------------------------------------------------------------------------


async def test_a_raising_function_fails_only_its_sample() -> None:
    def fn(prompt: str, response: str, **meta: Any) -> float:
        if response == "5":
            raise ValueError("cannot parse 5")
        return 1.0

    r = runner(fn)
    out = await r.score(SAMPLES)
    assert out[0] == RewardResult(1.0, True)
    assert out[1] == RewardResult(0.0, False, "ValueError: cannot parse 5", "error")
    assert out[2].ok
    stats = r.statistics()
    assert (stats.samples, stats.ok, stats.failures["error"]) == (3, 2, 1)


async def test_an_error_that_cannot_be_printed_is_still_an_error() -> None:
    def fn(prompt: str, response: str, **meta: Any) -> float:
        raise ValueError(10**5000)  # str() of it raises: the int is too long to print

    out = await runner(fn).score(SAMPLES[:1])
    assert (out[0].ok, out[0].kind) == (False, "error")
    assert (out[0].error or "").startswith("ValueError")


async def test_unexpected_keyword_is_an_error_not_a_crash() -> None:
    def fn(prompt: str, response: str) -> float:
        return 1.0

    out = await runner(fn).score(SAMPLES[:1])
    assert not out[0].ok
    assert out[0].kind == "error"
    assert "answer" in (out[0].error or "")


async def test_system_exit_in_a_sync_function_is_contained() -> None:
    def fn(prompt: str, response: str, **meta: Any) -> float:
        raise SystemExit(3)

    out = await runner(fn).score(SAMPLES[:1])
    assert (out[0].ok, out[0].kind) == (False, "error")
    assert "SystemExit" in (out[0].error or "")


async def test_a_hung_sync_function_times_out_promptly(release: threading.Event) -> None:
    def fn(prompt: str, response: str, **meta: Any) -> float:
        release.wait()
        return 1.0

    r = runner(fn, timeout_s=0.2)
    t0 = time.monotonic()
    out = await r.score(SAMPLES[:2])
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0
    assert [(x.ok, x.kind) for x in out] == [(False, "timeout")] * 2
    assert out[0].error == "timed out after 0.2s"
    assert r.statistics().abandoned_threads == 2
    assert r.statistics().failures["timeout"] == 2
    # Once the hung calls return, their threads are accounted for.
    release.set()
    async with asyncio.timeout(5):
        await r.wait_unabandoned()
    assert r.statistics().abandoned_threads == 0


async def test_hung_threads_are_bounded(release: threading.Event) -> None:
    def fn(prompt: str, response: str, **meta: Any) -> float:
        release.wait()
        return 1.0

    r = runner(fn, timeout_s=1.0, max_concurrency=2)
    first = await r.score(SAMPLES[:2])
    assert [x.kind for x in first] == ["timeout", "timeout"]
    threads_before = threading.active_count()
    t0 = time.monotonic()
    second = await r.score(SAMPLES)
    assert time.monotonic() - t0 < 0.5  # fails at once instead of waiting out the timeout
    assert [x.kind for x in second] == ["stuck"] * 3
    assert threading.active_count() == threads_before  # no new thread was started
    assert r.statistics().failures["stuck"] == 3
    release.set()
    async with asyncio.timeout(5):
        await r.wait_unabandoned()
    third = await r.score(SAMPLES[:1])
    assert third == [RewardResult(1.0, True)]


async def test_a_hung_async_function_times_out_promptly() -> None:
    async def fn(prompt: str, response: str, **meta: Any) -> float:
        await asyncio.Event().wait()
        return 1.0

    t0 = time.monotonic()
    out = await runner(fn, timeout_s=0.2).score(SAMPLES)
    assert time.monotonic() - t0 < 2.0
    assert [x.kind for x in out] == ["timeout"] * 3


async def test_a_timeout_raised_by_the_function_itself_is_an_error() -> None:
    async def fn(prompt: str, response: str, **meta: Any) -> float:
        raise TimeoutError("upstream verifier timed out")

    out = await runner(fn, timeout_s=5).score(SAMPLES[:1])
    assert out[0].kind == "error"
    assert out[0].error == "TimeoutError: upstream verifier timed out"


async def _coroutine_result() -> float:
    return 1.0


class _BadFloat:
    """A value whose conversion to float raises something other than TypeError/ValueError."""

    def __float__(self) -> float:
        raise ZeroDivisionError("no float for you")


class _BadSequence:
    """A batch result whose length cannot be taken."""

    def __len__(self) -> int:
        raise RuntimeError("no length")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, RewardResult(1.0, True)),
        (3, RewardResult(3.0, True)),
        (Fraction(1, 4), RewardResult(0.25, True)),
        ("abc", None),
        ("1.0", None),  # strings are never parsed
        (math.nan, None),
        (-math.inf, None),
        (None, None),
        ([1.0], None),
        (1 + 2j, None),
        pytest.param(10**400, None, id="int-too-big-for-a-float"),
        pytest.param(Fraction(10**400, 3), None, id="fraction-too-big-for-a-float"),
        pytest.param(-(10**5000), None, id="int-too-big-to-print"),
        pytest.param(_BadFloat(), None, id="float-raises"),
    ],
)
async def test_garbage_values_fail_the_sample(value: Any, expected: RewardResult | None) -> None:
    def fn(prompt: str, response: str, **meta: Any) -> Any:
        return value

    r = runner(fn)
    out = await r.score(SAMPLES[:1])
    if expected is not None:
        assert out == [expected]
    else:
        assert (out[0].reward, out[0].ok, out[0].kind) == (0.0, False, "invalid")
        assert out[0].error
        assert r.statistics().failures["invalid"] == 1


async def test_numpy_and_tensor_scalars_are_numbers() -> None:
    import numpy as np
    import torch

    values = iter([np.float32(0.5), torch.tensor(0.25), np.int64(2)])

    def fn(prompt: str, response: str, **meta: Any) -> Any:
        return next(values)

    out = await runner(fn, max_concurrency=1).score(SAMPLES)
    assert [x.reward for x in out] == [0.5, 0.25, 2.0]


async def test_a_sync_function_returning_a_coroutine_is_invalid_and_quiet() -> None:
    def fn(prompt: str, response: str, **meta: Any) -> Any:
        return _coroutine_result()  # forgot `async def`; must not warn "never awaited"

    out = await runner(fn).score(SAMPLES[:1])
    assert out[0].kind == "invalid"
    assert "async def" in (out[0].error or "")


@pytest.mark.parametrize(
    ("value", "kinds"),
    [
        ([1.0, 2.0], ["invalid"] * 3),  # wrong length
        ("abc", ["invalid"] * 3),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, ["invalid"] * 3),
        (42, ["invalid"] * 3),
        ([1.0, math.nan, "x"], [None, "invalid", "invalid"]),
        pytest.param([10**400, Fraction(10**400), 0.5], ["invalid", "invalid", None],
                     id="too-big-for-a-float"),
        pytest.param(_BadSequence(), ["invalid"] * 3, id="len-raises"),
    ],
)
async def test_batched_garbage(value: Any, kinds: list[str | None]) -> None:
    def fn(prompts: list[str], responses: list[str], metas: list[dict[str, Any]]) -> Any:
        return value

    out = await runner(fn, batched=True).score(SAMPLES)
    assert [x.kind for x in out] == kinds
    assert all(x.reward == 0.0 for x in out if not x.ok)


async def test_a_raising_batched_function_fails_every_sample() -> None:
    async def fn(prompts: list[str], responses: list[str], metas: list[dict[str, Any]]) -> Any:
        raise RuntimeError("verifier down")

    out = await runner(fn, batched=True).score(SAMPLES)
    assert [(x.ok, x.kind, x.error) for x in out] == [
        (False, "error", "RuntimeError: verifier down")] * 3


async def test_unparsable_samples_score_their_fallback_and_are_counted() -> None:
    def batch(prompts: list[str], responses: list[str], metas: list[dict[str, Any]]) -> Any:
        return [0.5, Unparsable(-1.0, "no score in 'meh'"), Unparsable(math.nan, "nan")]

    r = runner(batch, batched=True)
    out = await r.score(SAMPLES)
    assert out == [RewardResult(0.5, True),
                   RewardResult(-1.0, False, "no score in 'meh'", "unparsable"),
                   RewardResult(0.0, False, "returned nan, expected a finite number", "invalid")]
    assert r.statistics().failures == {"error": 0, "timeout": 0, "invalid": 1, "stuck": 0,
                                       "unparsable": 1}

    async def one(prompt: str, response: str, **meta: Any) -> Any:
        return Unparsable(0.25, "unreadable") if response == "5" else 1.0

    out = await runner(one).score(SAMPLES)
    assert [(x.reward, x.kind) for x in out] == [(1.0, None), (0.25, "unparsable"), (1.0, None)]


async def test_cancelling_score_propagates(release: threading.Event) -> None:
    loop = asyncio.get_running_loop()
    started = asyncio.Event()

    def fn(prompt: str, response: str, **meta: Any) -> float:
        loop.call_soon_threadsafe(started.set)
        release.wait()
        return 1.0

    r = runner(fn, timeout_s=10)
    task = asyncio.create_task(r.score(SAMPLES[:1]))
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.statistics().abandoned_threads == 1
    release.set()
    async with asyncio.timeout(5):
        await r.wait_unabandoned()


def test_constructor_checks_arguments() -> None:
    with pytest.raises(TypeError):
        runner("not callable")
    with pytest.raises(ValueError, match="timeout_s"):
        runner(exact_match, timeout_s=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        runner(exact_match, max_concurrency=0)


# ---- references and the built-in reward ----------------------------------------------------------


def test_resolve_module_reference() -> None:
    assert resolve_reward_fn("workers.roles.builtin_rewards:exact_match") is exact_match
    assert resolve_reward_fn("os.path:join") is __import__("os").path.join


def test_resolve_file_reference(tmp_path: Path) -> None:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent("""
        from dataclasses import dataclass

        @dataclass
        class Rubric:
            bonus: float

        RUBRIC = Rubric(0.5)

        def score(prompt, response, **meta):
            return len(response) + RUBRIC.bonus
    """))
    fn = resolve_reward_fn(f"{path}:score")
    assert fn("p", "abc") == 3.5
    assert resolve_reward_fn(f"{path}:score") is fn  # the file runs once per process


@pytest.mark.parametrize(
    ("ref", "text"),
    [
        ("no_colon", "is not 'module:function'"),
        ("mod:1bad", "is not 'module:function'"),
        ("flowrl_no_such_module:f", "cannot load 'flowrl_no_such_module'"),
        ("workers.roles.reward_runner:nope", "has no 'nope'"),
        ("flowrl.reward_fn:MAX_ERROR_CHARS", "is a int, not callable"),
        ("/no/such/file.py:f", "no such file"),
    ],
)
def test_resolve_errors(ref: str, text: str) -> None:
    with pytest.raises(RewardFnError, match=text):
        resolve_reward_fn(ref)


def test_resolve_a_file_that_fails_to_import(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardFnError, match="RuntimeError: boom"):
        resolve_reward_fn(f"{path}:f")
    path.write_text("def f(prompt, response, **meta):\n    return 2.0\n")
    assert resolve_reward_fn(f"{path}:f")("p", "r") == 2.0  # a failed load is not cached


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [("19", "19", 1.0), ("  19\n", 19, 1.0), ("19.", "19", 1.0), ("19 apples", "19", 1.0),
     ("190", "19", 0.0), ("1", "19", 0.0), ("", "19", 0.0), ("x19", "19", 0.0),
     ("anything", "", 0.0)],
)
def test_exact_match(response: str, answer: Any, expected: float) -> None:
    assert exact_match("p", response, answer=answer, extra="ignored") == expected
