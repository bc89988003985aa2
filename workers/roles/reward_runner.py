"""The reward role's logic: call a user's reward function without letting it hurt the worker.

`RewardRunner.score` turns samples (prompt text, response text, the dataset row's metadata)
into one `RewardResult` each. Guarantees:

- ``score`` never raises because of the user function (only when the caller cancels it): a call
  that raises, exceeds ``timeout_s`` or returns garbage (not a number, NaN or infinite, too big
  for a float such as ``10**400``, a batch of the wrong length) gives its samples
  ``reward = 0.0, ok = False`` and the error text, and is counted by kind in
  `RewardRunner.statistics`.
- A function may return `Unparsable` for a sample (a grader whose output it could not read,
  such as a judge model's verdict without a score): the sample gets that value's fallback
  reward, ``ok = False`` and kind ``unparsable``.
- The event loop stays free: sync functions run in threads, async functions on the loop under a
  timeout scope. At most ``max_concurrency`` calls run at once.
- Threads are bounded. Python cannot kill a thread, so a sync call that hangs past its timeout
  keeps its thread until it returns; it is then *abandoned* (the caller moves on, its slot is
  freed). While ``max_concurrency`` or more calls are abandoned, sync calls fail at once (kind
  ``stuck``) instead of starting threads, until abandoned calls return. A thread starts only
  when fewer than ``max_concurrency`` are abandoned and at most ``max_concurrency`` run, so fewer
  than ``2 * max_concurrency`` threads ever exist. The threads are daemon threads, not a
  ``ThreadPoolExecutor``'s: an executor joins its threads at interpreter exit, so one hung call
  would keep the worker process alive forever.
- An async function is cancelled at its timeout; one that swallows cancellation, or blocks the
  loop with sync work, defeats the timeout (nothing can prevent that in-process).

Per-sample functions are called ``fn(prompt, response, **meta)``; batched ones
``fn(prompts, responses, metas)`` and return one number per sample. References are resolved by
`flowrl.reward_fn` (re-exported here). Imports only the standard library and that module.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flowrl.reward_fn import (
    MAX_ERROR_CHARS,
    RewardFnError,
    describe_error,
    printable,
    resolve_reward_fn,
)

__all__ = [
    "FailureKind",
    "RewardFnError",
    "RewardResult",
    "RewardRunner",
    "RewardSample",
    "RewardStats",
    "Unparsable",
    "resolve_reward_fn",
]

FailureKind = Literal["error", "timeout", "invalid", "stuck", "unparsable"]
"""Why a sample's reward failed: the function raised, ran past its timeout, returned something
that is not a finite number (or a batch of the wrong length), every thread was hung, or it
returned `Unparsable` (its grader's output held no score)."""
_KINDS: tuple[FailureKind, ...] = ("error", "timeout", "invalid", "stuck", "unparsable")



@dataclass(frozen=True, slots=True)
class RewardSample:
    """One response to score; ``meta`` is the dataset row's metadata (e.g. ``answer``)."""

    prompt: str
    response: str
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Unparsable:
    """What a function returns for a sample whose grader output it could not read: the sample
    scores ``reward`` (a finite fallback) and is counted as failed, kind ``unparsable``."""

    reward: float
    error: str


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A sample's reward; when ``ok`` is False the reward is 0.0 (an `Unparsable` sample's:
    its fallback) and ``error`` says why."""

    reward: float
    ok: bool
    error: str | None = None
    kind: FailureKind | None = None


@dataclass(frozen=True, slots=True)
class RewardStats:
    """A snapshot of a runner's counters."""

    calls: int
    samples: int
    ok: int
    failures: Mapping[str, int]
    """Failed samples by `FailureKind`."""
    abandoned_threads: int
    """Sync calls that ran past their timeout and have not returned yet."""


class _Failure(Exception):
    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind


@dataclass(slots=True)
class _ThreadCall:
    future: asyncio.Future[Any]
    finished: bool = False
    abandoned: bool = False


def _is_async(fn: Callable[..., Any]) -> bool:
    call = getattr(fn, "__call__", None)  # noqa: B004 — callable objects with an async __call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _short_repr(value: Any) -> str:
    text = printable(value, repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_reward(value: Any) -> float:
    """A finite float, or `_Failure("invalid")`. Accepts bools, ints, floats and scalars that
    convert with ``float()`` (numpy, 0-d tensors); never parses strings. A number too big for
    a float (``10**400``, a huge ``Fraction``) is invalid, as is any value whose conversion
    raises."""
    if inspect.iscoroutine(value):
        value.close()  # a sync function returned a coroutine: close it so it warns nobody
        raise _Failure("invalid", "returned a coroutine; declare the function `async def`")
    if isinstance(value, str | bytes) or not (
        isinstance(value, numbers.Real) or hasattr(value, "__float__")
    ):
        raise _Failure("invalid", f"returned {type(value).__name__} {_short_repr(value)}, "
                                  "expected a number")
    try:
        x = float(value)
    except Exception as e:  # OverflowError for 10**400; anything a user's __float__ raises
        raise _Failure("invalid", f"returned {type(value).__name__} {_short_repr(value)}: "
                                  f"{describe_error(e)}") from None
    if not math.isfinite(x):
        raise _Failure("invalid", f"returned {x}, expected a finite number")
    return x


def _result(value: Any) -> RewardResult:
    """A sample's result from the function's value for it, or `_Failure("invalid")`."""
    if isinstance(value, Unparsable):
        return RewardResult(_as_reward(value.reward), False, printable(value.error, str)[
            :MAX_ERROR_CHARS], "unparsable")
    return RewardResult(_as_reward(value), True)


def _as_batch(values: Any, samples: int) -> list[Any]:
    """A batched function's result as a list of `samples` values, or `_Failure("invalid")`."""
    if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
        raise _Failure("invalid", f"returned {type(values).__name__}, expected one number per "
                                  f"sample ({samples})")
    try:
        out = list(values)
    except Exception as e:  # a user's sequence whose iteration raises
        raise _Failure("invalid",
                       f"returned {type(values).__name__}: {describe_error(e)}") from None
    if len(out) != samples:
        raise _Failure("invalid", f"returned {len(out)} values for {samples} samples")
    return out


class RewardRunner:
    """Scores samples with a user reward function; see the module docstring for guarantees."""

    def __init__(
        self, fn: Callable[..., Any], *, batched: bool, timeout_s: float, max_concurrency: int,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"reward function must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.fn = fn
        self.batched = batched
        self.timeout_s = float(timeout_s)
        self.max_concurrency = max_concurrency
        self._async = _is_async(fn)
        # Calls in flight (sync or async); a slot is freed when its caller stops waiting.
        self._slots = asyncio.Semaphore(max_concurrency)
        self._max_abandoned = max_concurrency
        self._abandoned = 0
        self._none_abandoned = asyncio.Event()
        self._none_abandoned.set()
        self._counts: collections.Counter[str] = collections.Counter()

    # ---- public ---------------------------------------------------------------------------------

    async def score(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        """One result per sample, in order. Never raises for the user function's faults."""
        if not samples:
            return []
        if self.batched:
            results = await self._score_batch(samples)
        else:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._score_one(s)) for s in samples]
            results = [t.result() for t in tasks]
        self._counts["samples"] += len(results)
        for r in results:
            self._counts[r.kind or "ok"] += 1
        return results

    def statistics(self) -> RewardStats:
        c = self._counts
        return RewardStats(calls=c["calls"], samples=c["samples"], ok=c["ok"],
                           failures={k: c[k] for k in _KINDS}, abandoned_threads=self._abandoned)

    async def wait_unabandoned(self) -> None:
        """Wait until every abandoned (timed-out) sync call has returned."""
        await self._none_abandoned.wait()

    # ---- scoring --------------------------------------------------------------------------------

    async def _score_one(self, s: RewardSample) -> RewardResult:
        try:
            return _result(await self._call((s.prompt, s.response), dict(s.meta)))
        except _Failure as f:
            return RewardResult(0.0, False, str(f), f.kind)

    async def _score_batch(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        args = ([s.prompt for s in samples], [s.response for s in samples],
                [dict(s.meta) for s in samples])
        try:
            values = _as_batch(await self._call(args, {}), len(samples))
        except _Failure as f:
            return [RewardResult(0.0, False, str(f), f.kind) for _ in samples]
        out = []
        for v in values:
            try:
                out.append(_result(v))
            except _Failure as f:
                out.append(RewardResult(0.0, False, str(f), f.kind))
        return out

    async def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The function's return value, or `_Failure`; a cancelled caller propagates."""
        async with self._slots:
            self._counts["calls"] += 1
            try:
                async with asyncio.timeout(self.timeout_s) as scope:
                    if self._async:
                        return await self.fn(*args, **kwargs)
                    return await self._in_thread(args, kwargs)
            except _Failure:
                raise
            except Exception as e:
                if scope.expired():
                    raise _Failure("timeout", f"timed out after {self.timeout_s:g}s") from None
                raise _Failure("error", describe_error(e)) from None

    # ---- threads for sync functions -----------------------------------------------------------

    async def _in_thread(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._abandoned >= self._max_abandoned:
            raise _Failure("stuck", f"{self._abandoned} reward threads are still hung in calls "
                                    f"that timed out (limit {self._max_abandoned})")
        loop = asyncio.get_running_loop()
        call = _ThreadCall(loop.create_future())
        threading.Thread(target=self._thread_main, args=(loop, call, args, kwargs),
                         name="flowrl-reward", daemon=True).start()
        try:
            return await call.future
        finally:
            if not call.finished:  # the caller gave up (timeout or cancel); the thread runs on
                call.abandoned = True
                self._abandoned += 1
                self._none_abandoned.clear()

    def _thread_main(
        self, loop: asyncio.AbstractEventLoop, call: _ThreadCall, args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = self.fn(*args, **kwargs)
        except Exception as e:
            error = e
        except BaseException as e:  # SystemExit/KeyboardInterrupt raised by user code
            error = RuntimeError(describe_error(e))
        # RuntimeError: the loop is closed, so nobody is waiting for this result any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._thread_done, call, value, error)

    def _thread_done(self, call: _ThreadCall, value: Any, error: BaseException | None) -> None:
        # Runs on the loop, so the counters need no lock.
        call.finished = True
        if call.abandoned:
            if inspect.iscoroutine(value):
                value.close()
            self._abandoned -= 1
            if self._abandoned == 0:
                self._none_abandoned.set()
        elif not call.future.done():
            if error is not None:
                call.future.set_exception(error)
            else:
                call.future.set_result(value)
