"""Continuous batching on `HFRolloutEngine`: requests join and leave one running batch between
decode steps.

Many episodes generate at once, each turn a separate request that arrives whenever its episode
gets there. `ContinuousBatcher.generate` queues a request and resolves when its sequence ends;
one driver task advances the running batch a decode step at a time (in a thread, so the event
loop stays free) and, between steps, admits queued requests (one prefill for those that arrived
together, whose KV cache is then merged into the running one) and retires finished sequences
(their cache rows dropped). So a decode forward carries every running sequence, whichever
episode and turn it belongs to.

The running batch is left-padded: every row's tokens end at the last column and the attention
mask marks each row's real tokens, so rows of different lengths share one cache; position ids
follow each row's own count of tokens, so a row computes exactly what it would alone (the
trainer's right-padded recomputation matches it). Columns that no remaining row uses are cut
off the left when rows retire.

Sampling is per row: the engine's sampler (`hf_rollout._sample`: temperature, top-k, top-p,
logprob contract of `protocols`) over the rows that share settings, with uniforms drawn from
each request's own counter-based stream (``stream_key``, token index), so a request samples the
same tokens from the same weights whatever else shares the batch.

Weights: each step holds the batcher's lock, and so does `ContinuousBatcher.exclusive` (a
weight load), so the model never changes during a forward. Each token records the version of
the weights that computed the logits it was sampled from (``Generation.token_versions``).

Interruptible generation (`ContinuousBatcher.swap`): new weights are loaded at the next
decode-step boundary while sequences are running, and every running sequence continues under
them with all its tokens kept; none is restarted. By default the KV cache of the kept prefix is
kept too: it was computed under the old weights (the cheap choice); only each row's last
position is recomputed, so every token sampled after the swap comes from the new weights'
logits. With ``rebuild_kv`` the kept prefixes are prefilled again under the new weights: the
continuation is then exactly the new policy's, for the cost of one prefill of every running row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from flowrl.episode import MAX_RUNNING
from workers.engines.batching import BatchStats, StepGate, checked_request, generation_of
from workers.engines.hf_rollout import HFRolloutEngine, _sample, new_cache
from workers.engines.protocols import (
    FinishReason,
    Generation,
    SamplingParams,
    counter_uniforms,
)

__all__ = ["BatchStats", "ContinuousBatcher", "RunningBatch"]

_M32 = 0xFFFFFFFF
T = TypeVar("T")
#: decode steps one driver call may run while no sequence ends and no request waits
_STEPS_PER_CALL = 16


@dataclass
class _Seq:
    """One request in the running batch."""

    context: list[int]
    params: SamplingParams
    stream_key: int
    future: asyncio.Future[Generation]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    #: the version of the weights that computed this row's pending next-token logits
    logits_version: int = 0

    def result(self, reason: FinishReason) -> Generation:
        return generation_of(self.tokens, self.logprobs, self.versions, reason)


def _cache_kv(cache: Any) -> list[tuple[Tensor, Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_cache_kv(cache: Any, kv: list[tuple[Tensor, Tensor]]) -> None:
    layers = getattr(cache, "layers", None)
    for i, (k, v) in enumerate(kv):
        if layers is not None:
            layers[i].keys, layers[i].values = k, v
        else:
            cache.key_cache[i], cache.value_cache[i] = k, v


def _left_pad(x: Tensor, width: int, dim: int) -> Tensor:
    """``x`` with zeros before it along ``dim`` up to ``width``."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class RunningBatch:
    """The decode state of the running sequences. Not thread-safe: one call at a time."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine
        self.seqs: list[_Seq] = []
        self._cache: Any = None
        self._mask: Tensor | None = None  # [B, W] 1 on real tokens
        self._next_pos: Tensor | None = None  # [B, 1]
        self._logits: Tensor | None = None  # [B, V]: each row's next-token logits

    @property
    def rows(self) -> int:
        return len(self.seqs)

    def _forward(self, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any) -> Tensor:
        names = self.engine.forward_names
        kwargs: dict[str, Any] = {names.cache: cache, "use_cache": True}
        if names.keep is not None:
            kwargs[names.keep] = 1
        out = self.engine.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                **kwargs)
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def admit(self, seqs: Sequence[_Seq]) -> None:
        """Prefill ``seqs`` (each its context and the tokens it has generated so far) together
        and merge them into the running batch."""
        if not seqs:
            return
        device = self.engine.device
        prefixes = [s.context + s.tokens for s in seqs]
        width = max(len(p) for p in prefixes)
        ids = torch.full((len(seqs), width), self.engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, prefix in enumerate(prefixes):
            ids[i, width - len(prefix):] = torch.as_tensor(prefix, dtype=torch.long)
            mask[i, width - len(prefix):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache(self.engine.model)
        logits = self._forward(ids, mask, positions, cache)
        next_pos = positions[:, -1:] + 1
        if not self.seqs:
            self._cache, self._mask, self._next_pos, self._logits = cache, mask, next_pos, logits
        else:
            assert self._mask is not None
            assert self._next_pos is not None
            assert self._logits is not None
            both = max(self._mask.shape[1], width)
            merged = [
                (torch.cat([_left_pad(k0, both, 2), _left_pad(k1, both, 2)]),
                 torch.cat([_left_pad(v0, both, 2), _left_pad(v1, both, 2)]))
                for (k0, v0), (k1, v1) in zip(_cache_kv(self._cache), _cache_kv(cache),
                                              strict=True)
            ]
            _set_cache_kv(self._cache, merged)
            self._mask = torch.cat([_left_pad(self._mask, both, 1), _left_pad(mask, both, 1)])
            self._next_pos = torch.cat([self._next_pos, next_pos])
            self._logits = torch.cat([self._logits, logits])
        for s in seqs:
            s.logits_version = self.engine.version
        self.seqs.extend(seqs)

    def refresh(self, *, rebuild_kv: bool = False) -> None:
        """After a weight load: continue every row under the new weights, its tokens kept. Its
        last position is computed again over the kept KV cache (computed under the old
        weights), or with ``rebuild_kv`` its whole prefix is prefilled again; either way its
        next token is sampled from the new weights' logits."""
        if not self.seqs:
            return
        if rebuild_kv:
            self.admit(self.reset())
            return
        assert self._mask is not None
        assert self._next_pos is not None
        # Every row's last token is in the last column: drop its KV and compute it again.
        _set_cache_kv(self._cache, [(k[:, :, :-1], v[:, :, :-1])
                                    for k, v in _cache_kv(self._cache)])
        last = torch.tensor([[(s.tokens or s.context)[-1]] for s in self.seqs],
                            dtype=torch.long, device=self.engine.device)
        self._logits = self._forward(last, self._mask, self._next_pos - 1, self._cache)
        for s in self.seqs:
            s.logits_version = self.engine.version

    def drop(self, rows: Sequence[int]) -> None:
        """Remove ``rows`` (indices into `seqs`) from the batch, cache included."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(len(self.seqs)) if i not in gone]
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._next_pos = self._logits = None
            return
        assert self._mask is not None
        assert self._next_pos is not None
        assert self._logits is not None
        index = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
        self._cache.batch_select_indices(index)
        self._mask, self._next_pos = self._mask[index], self._next_pos[index]
        self._logits = self._logits[index]
        # Columns no remaining row uses (left padding of longer rows that left) are cut off.
        used = self._mask.any(dim=0)
        first = int(used.int().argmax())
        if first > 0:
            _set_cache_kv(self._cache, [(k[:, :, first:], v[:, :, first:])
                                        for k, v in _cache_kv(self._cache)])
            self._mask = self._mask[:, first:]

    def step(self) -> list[tuple[_Seq, FinishReason]]:
        """Sample one token for every row, retire the rows that ended, and run the decode
        forward of the rest. Returns the ended sequences with why they ended."""
        if not self.seqs:
            return []
        assert self._logits is not None
        assert self._mask is not None
        assert self._next_pos is not None
        device = self.engine.device
        keys = torch.tensor([[s.stream_key & _M32, s.stream_key >> 32] for s in self.seqs],
                            dtype=torch.int64, device=device)
        counters = torch.tensor([len(s.tokens) for s in self.seqs], dtype=torch.int64,
                                device=device)
        tokens = torch.zeros(len(self.seqs), dtype=torch.long, device=device)
        lps = torch.zeros(len(self.seqs), dtype=torch.float32, device=device)
        by_setting: dict[tuple[float, float, int], list[int]] = {}
        for i, s in enumerate(self.seqs):
            p = s.params
            by_setting.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
        for rows in by_setting.values():
            idx = torch.tensor(rows, dtype=torch.long, device=device)
            params = self.seqs[rows[0]].params
            u = (counter_uniforms(keys[idx], counters[idx]) if params.temperature > 0.0
                 else None)
            t, lp = _sample(self._logits[idx], params, u)
            tokens[idx], lps[idx] = t, lp
        ended: list[tuple[_Seq, FinishReason]] = []
        ended_rows: list[int] = []
        stop_ids = self.engine.stop_ids
        for i, (s, tok, lp) in enumerate(zip(self.seqs, tokens.tolist(), lps.tolist(),
                                             strict=True)):
            s.tokens.append(int(tok))
            s.logprobs.append(float(lp))
            s.versions.append(s.logits_version)
            reason: FinishReason | None = None
            if tok in stop_ids or tok in s.params.stop_token_ids or (
                    s.params.stop and self._completes_stop_string(s)):
                reason = "stop"
            elif len(s.tokens) >= s.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                ended.append((s, reason))
                ended_rows.append(i)
        if ended_rows:
            kept = [i for i in range(len(self.seqs)) if i not in set(ended_rows)]
            tokens = tokens[torch.tensor(kept, dtype=torch.long, device=device)]
            self.drop(ended_rows)
        if self.seqs:
            assert self._mask is not None
            assert self._next_pos is not None
            self._mask = torch.cat([self._mask, self._mask.new_ones((self._mask.shape[0], 1))],
                                   dim=1)
            self._logits = self._forward(tokens.unsqueeze(-1), self._mask, self._next_pos,
                                         self._cache)
            self._next_pos = self._next_pos + 1
            for s in self.seqs:
                s.logits_version = self.engine.version
        return ended

    def _completes_stop_string(self, s: _Seq) -> bool:
        # Every token decodes to at least one byte: this many tokens cover any stop string.
        window = max(len(x.encode()) for x in s.params.stop)
        text = self.engine.text_tokenizer().decode(
            s.tokens[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return any(x in text for x in s.params.stop)

    def reset(self) -> list[_Seq]:
        """Drop every row (after a failed step); returns them."""
        seqs, self.seqs = self.seqs, []
        self._cache = self._mask = self._next_pos = self._logits = None
        return seqs


class ContinuousBatcher:
    """Serves generation requests from many coroutines on one `HFRolloutEngine`."""

    def __init__(self, engine: HFRolloutEngine, *, max_running: int = MAX_RUNNING,
                 batch: RunningBatch | None = None) -> None:
        """``batch``: the decode state to drive (default: a `RunningBatch` of ``engine``;
        simulation mode passes one whose steps cost modelled time, `workers.sim_episode`)."""
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.engine = engine
        self.max_running = max_running
        self.stats = BatchStats()
        self._batch = RunningBatch(engine) if batch is None else batch
        self._queue: list[_Seq] = []
        self._driver: asyncio.Task[None] | None = None
        self._gate = StepGate()

    async def generate(
        self, context: Sequence[int], params: SamplingParams, *, stream_key: int
    ) -> Generation:
        """Sample one continuation of ``context`` (``params.n`` must be 1); ``stream_key``
        (64 bits) keys its sampling stream."""
        ids = checked_request(context, params, self.engine.max_positions)
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._queue.append(_Seq(ids, params, int(stream_key) & ((1 << 64) - 1), future))
        self.stats.requests += 1
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await future

    @property
    def running(self) -> int:
        """Sequences in the running batch."""
        return self._batch.rows

    async def exclusive(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a thread between decode steps (a weight load)."""
        async with self._gate.turn():
            return await asyncio.to_thread(fn)

    async def swap(self, load: Callable[[], Any], *, rebuild_kv: bool = False) -> int:
        """Run ``load`` (a weight load) in a thread at the next decode-step boundary and
        continue every running sequence under the new weights (`RunningBatch.refresh`).
        Returns how many sequences were continued. A load that raises changes nothing here;
        should continuing fail after it, the running requests fail with the error (as after
        a failed step)."""
        async with self._gate.turn():
            await asyncio.to_thread(load)
            rows = self._batch.rows
            if not rows:
                return 0
            try:
                await asyncio.to_thread(self._batch.refresh, rebuild_kv=rebuild_kv)
            except Exception as e:
                for s in self._batch.reset():
                    if not s.future.done():
                        s.future.set_exception(e)
                return 0
        self.stats.interruptions += 1
        self.stats.interrupted_rows += rows
        return rows

    def _advance(self, new: list[_Seq], cancelled: list[int]) -> list[tuple[_Seq, FinishReason]]:
        """Admit ``new``, then decode until a sequence ends, a request waits or a weight load
        waits (up to `_STEPS_PER_CALL` steps: one thread hop for several steps, and no
        request or load waits longer than a step)."""
        self._batch.drop(cancelled)
        if new:
            self._batch.admit(new)
            self.stats.prefills += 1
        for _ in range(_STEPS_PER_CALL):
            rows = self._batch.rows
            ended = self._batch.step()
            if rows - len(ended) > 0:
                self.stats.forwards += 1
                self.stats.rows += rows - len(ended)
            # The queue is appended to on the event loop's thread; reading its length here
            # is atomic, and a request that slips past this check waits one step.
            if ended or self._queue or self._gate.waiting or not self._batch.rows:
                return ended
        return []

    async def _drive(self) -> None:
        while self._queue or self._batch.rows:
            self._queue = [s for s in self._queue if not s.future.done()]
            room = self.max_running - self._batch.rows
            new, self._queue = self._queue[:room], self._queue[room:]
            cancelled = [i for i, s in enumerate(self._batch.seqs) if s.future.done()]
            try:
                async with self._gate.lock:
                    ended = await asyncio.to_thread(self._advance, new, cancelled)
            except Exception as e:  # a failed step fails its requests, not the batcher
                for s in [*self._batch.reset(), *new]:
                    if not s.future.done():
                        s.future.set_exception(e)
                continue
            for s, reason in ended:
                if not s.future.done():
                    s.future.set_result(s.result(reason))
