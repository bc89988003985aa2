"""What the episode rollout role needs of an engine that batches requests continuously.

Two batchers satisfy `RequestBatcher`: `workers.engines.hf_continuous.ContinuousBatcher` (its
own decode loop over `HFRolloutEngine`) and `workers.engines.vllm_continuous.VLLMBatcher`
(vLLM's engine driven step by step). `workers.roles.episode_rollout.EpisodeRolloutRole` codes
against this protocol only, so episodes, tools, the endpoint and interruptible rollout are the
same on both.

Imports only torch (through `protocols`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from workers.engines.protocols import FinishReason, Generation, SamplingParams

__all__ = [
    "BatchStats", "BatchedEngine", "RequestBatcher", "StepGate", "checked_request", "generation_of",
]

T = TypeVar("T")


def checked_request(context: Sequence[int], params: SamplingParams, limit: int | None
                    ) -> list[int]:
    """A request's ``context`` as plain ints; raises
    ValueError for what no batcher serves: ``n`` other than 1, an empty context, or one that
    with ``max_new_tokens`` outgrows the model's ``limit`` positions."""
    if params.n != 1:
        raise ValueError("a batched request samples one continuation (n = 1)")
    if not context:
        raise ValueError("empty context")
    if limit is not None and len(context) + params.max_new_tokens > limit:
        raise ValueError(f"context ({len(context)}) + max_new_tokens "
                         f"({params.max_new_tokens}) exceeds the model's {limit} positions")
    return [int(t) for t in context]


@dataclass
class BatchStats:
    """What the batcher has done: decode forwards and the rows they carried, prefills."""

    forwards: int = 0
    rows: int = 0
    prefills: int = 0
    requests: int = 0
    #: weight swaps that found sequences running, and how many sequences they continued
    interruptions: int = 0
    interrupted_rows: int = 0

    @property
    def mean_rows(self) -> float:
        """Mean sequences per decode forward (the batch's occupancy)."""
        return self.rows / self.forwards if self.forwards else 0.0


class BatchedEngine(Protocol):
    """The engine behind a batcher, as the role sees it."""

    @property
    def version(self) -> int:
        """The weight version currently loaded."""
        ...

    @property
    def max_positions(self) -> int | None:
        """The longest context plus response the model takes (None: no known limit)."""
        ...

    def load_weights(
        self, state: Mapping[str, Tensor], version: int, *, shared: bool = False
    ) -> None:
        """As `workers.engines.protocols.RolloutEngine.load_weights`."""
        ...


class RequestBatcher(Protocol):
    """Serves generation requests from many coroutines on one engine, batched between steps.

    Each token of a result records the version of the weights whose logits it was sampled
    from (``Generation.token_versions``).
    """

    @property
    def engine(self) -> BatchedEngine: ...

    @property
    def stats(self) -> BatchStats: ...

    @property
    def running(self) -> int:
        """Sequences being generated now."""
        ...

    async def generate(
        self, context: Sequence[int], params: SamplingParams, *, stream_key: int
    ) -> Generation:
        """Sample one continuation of ``context`` (``params.n`` must be 1); ``stream_key``
        (64 bits) keys its sampling, so a request samples the same tokens from the same
        weights whatever else shares the batch."""
        ...

    async def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread between steps, nothing running meanwhile (a weight load)."""
        ...

    async def swap(self, load: Callable[[], Any], *, rebuild_kv: bool = False) -> int:
        """Run ``load`` (a weight load) at the next step boundary and continue every running
        sequence under the new weights, its tokens kept (with ``rebuild_kv`` its KV cache is
        computed again under them). Returns how many sequences were continued."""
        ...


class StepGate:
    """One engine call at a time, a batch of steps or an exclusive call (a weight load), and
    an exclusive call waits for one step, not for a whole batch of them: the driver reads
    `waiting` between steps and gives way."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        #: exclusive calls waiting for the lock
        self.waiting = 0

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold the lock as an exclusive call."""
        self.waiting += 1
        try:
            await self.lock.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self.lock.release()


def generation_of(tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                  reason: FinishReason) -> Generation:
    """A batched request's result: its tokens, their logprobs and versions."""
    return Generation(
        prompt_index=0, response_ids=torch.tensor(tokens, dtype=torch.int64),
        logprobs=torch.tensor(logprobs, dtype=torch.float32), finish_reason=reason,
        version=versions[-1], token_versions=torch.tensor(versions, dtype=torch.int32))
