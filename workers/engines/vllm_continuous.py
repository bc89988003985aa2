"""Continuous batching on `VLLMRolloutEngine`: vLLM's own scheduler, driven a step at a time.

The vLLM counterpart of `workers.engines.hf_continuous.ContinuousBatcher` (both satisfy
`workers.engines.batching.RequestBatcher`). `VLLMBatcher.generate` queues a request and
resolves when it ends; one driver task adds queued requests to vLLM's engine, aborts those
whose caller gave up, and runs engine steps (in a thread, so the event loop stays free). vLLM
schedules every unfinished request into each step, so requests of many episodes join and leave
the running batch between steps, and its prefix cache reuses the KV blocks of an episode's
earlier turns.

Sampling: each request is seeded from its ``stream_key`` (a vLLM per-request seed), so it samples
the same tokens from the same weights whatever shares the batch (its stream differs from the HF
engine's).

Weights change only between steps: a step holds the batcher's lock, and so does a weight load
(`exclusive`, `swap`). Every token records the version loaded at the step that sampled it, which
is the version whose logits it was sampled from.

Interruptible generation (`VLLMBatcher.swap`): the load runs at the next step boundary while
requests run, and they continue under the new weights with every token kept; none is restarted.
By default their KV cache is kept too (computed under the old weights; the cheap choice): vLLM
computes each request's last sampled token at its next step, so every token sampled after the
swap comes from the new weights' logits, over old keys and values, as on the HF engine. With
``rebuild_kv`` vLLM preempts the running requests and prefills each one's prompt and tokens
again under the new weights before they go on. A request's prefix-cache blocks are salted with
the weights it started under, so no later request reuses them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workers.engines.batching import BatchStats, StepGate, checked_request, generation_of
from workers.engines.protocols import FinishReason, Generation, SamplingParams
from workers.engines.vllm_rollout import VLLMRolloutEngine

__all__ = ["VLLMBatcher"]

T = TypeVar("T")
#: engine steps one driver call may run while no request ends and no request or load waits
_STEPS_PER_CALL = 16


@dataclass
class _Request:
    context: list[int]
    params: SamplingParams
    seed: int
    future: asyncio.Future[Generation]
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class VLLMBatcher:
    """Serves generation requests from many coroutines on one `VLLMRolloutEngine`."""

    def __init__(self, engine: VLLMRolloutEngine) -> None:
        self.engine = engine
        self.stats = BatchStats()
        self._queue: list[_Request] = []
        self._live: dict[str, _Request] = {}  # request id -> request, added to vLLM
        self._ids = itertools.count()
        self._driver: asyncio.Task[None] | None = None
        self._gate = StepGate()

    async def generate(
        self, context: Sequence[int], params: SamplingParams, *, stream_key: int
    ) -> Generation:
        """Sample one continuation of ``context`` (``params.n`` must be 1); ``stream_key``
        (64 bits) seeds it."""
        ids = checked_request(context, params, self.engine.max_positions)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(ids, params, int(stream_key) & ((1 << 64) - 1), future))
        self.stats.requests += 1
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await future

    @property
    def running(self) -> int:
        """Requests in vLLM's engine."""
        return len(self._live)

    async def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread between steps (a weight load)."""
        async with self._gate.turn():
            return await asyncio.to_thread(fn)

    async def swap(self, load: Callable[[], Any], *, rebuild_kv: bool = False) -> int:
        """Run ``load`` (a weight load) in a thread at the next step boundary; the running
        requests continue under the new weights, their tokens kept (with ``rebuild_kv`` their
        KV cache too is computed again). Returns how many requests were continued. A load that
        raises changes nothing here; should the rebuild fail, the running requests fail with
        the error."""
        async with self._gate.turn():
            await asyncio.to_thread(load)
            rows = len(self._live)
            if not rows:
                return 0
            if rebuild_kv:
                try:
                    await asyncio.to_thread(self.engine.recompute_running)
                except Exception as e:
                    self._fail(e, [])
                    return 0
        self.stats.interruptions += 1
        self.stats.interrupted_rows += rows
        return rows

    def _advance(self, new: list[_Request], cancelled: list[str]
                 ) -> list[tuple[_Request, FinishReason]]:
        """Add ``new``, abort ``cancelled``, then step until a request ends, a request waits or
        a weight load waits (up to `_STEPS_PER_CALL` steps)."""
        if cancelled:
            self.engine.abort_requests(cancelled)
            for rid in cancelled:
                self._live.pop(rid, None)
        for r in new:
            r.request_id = f"r{next(self._ids)}"
            self.engine.add_request(r.request_id, r.context, r.params, seed=r.seed)
            self._live[r.request_id] = r
        if new:
            self.stats.prefills += 1
        for _ in range(_STEPS_PER_CALL):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM has no request left but {len(self._live)} are "
                                   "unfinished here")
            outputs = self.engine.step()
            version = self.engine.version
            ended: list[tuple[_Request, FinishReason]] = []
            for out in outputs:
                req = self._live.get(out.request_id)
                if req is None:  # aborted meanwhile
                    continue
                req.tokens.extend(out.token_ids)
                req.logprobs.extend(out.logprobs)
                req.versions.extend([version] * len(out.token_ids))
                if out.finish_reason is not None:
                    del self._live[out.request_id]
                    ended.append((req, out.finish_reason))
            if outputs:
                self.stats.forwards += 1
                self.stats.rows += len(outputs)
            # The queue is appended to on the event loop's thread; reading its length here is
            # atomic, and a request that slips past this check waits one step.
            if ended or self._queue or self._gate.waiting or not self._live:
                return ended
        return []

    def _fail(self, error: Exception, new: list[_Request]) -> None:
        """Fail every request in vLLM and ``new`` with ``error``, and drop them from vLLM."""
        live = list(self._live.values())
        self._live.clear()
        try:
            if live:
                self.engine.abort_requests([r.request_id for r in live])
        except Exception:  # the requests fail with the first error anyway
            pass
        for r in [*live, *new]:
            if not r.future.done():
                r.future.set_exception(error)

    async def _drive(self) -> None:
        while self._queue or self._live:
            self._queue = [r for r in self._queue if not r.future.done()]
            new, self._queue = self._queue, []
            cancelled = [rid for rid, r in self._live.items() if r.future.done()]
            async with self._gate.lock:
                try:
                    ended = await asyncio.to_thread(self._advance, new, cancelled)
                except Exception as e:  # a failed step fails its requests, not the batcher
                    self._fail(e, new)
                    continue
            for r, reason in ended:
                if not r.future.done():
                    r.future.set_result(generation_of(r.tokens, r.logprobs, r.versions, reason))
